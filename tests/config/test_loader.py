import json

import pytest

from neox.config import ConfigError, derive, load_config, load_dict
from neox.config.schema import ParallelConfig

GPT_NEOX_STYLE = """
# a gpt-neox config: a YAML flow mapping with comments, trailing commas and True/False
{
  "num-layers": 4,            # dashes are fine
  "hidden_size": 128,
  "num_attention_heads": 8,
  "seq_length": 256,
  "max_position_embeddings": 256,
  "pos_emb": "rotary",
  "rotary_pct": 0.25,
  "gpt_j_residual": True,
  "no_weight_tying": False,
  "attention_config": [[["flash"], 4]],
  "optimizer": {"type": "Adam", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8,},},
  "zero_optimization": {"stage": 1, "overlap_comm": True,},
  "fp16": {"enabled": True, "loss_scale": 0},
  "min_lr": 6.0e-5,
  "use_wandb": False,        # an unimplemented feature switched off is fine
}
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_gpt_neox_flow_mapping_parses(tmp_path):
    cfg = load_config([write(tmp_path, "a.yml", GPT_NEOX_STYLE)]).config
    assert cfg.model.num_layers == 4
    assert cfg.model.gpt_j_residual is True
    assert cfg.model.shape.layer_types == ("flash",) * 4
    # `6e-4` is YAML 1.1's string form; it must reach DeepSpeed/torch as a float.
    assert cfg.optimizer.optimizer.params["lr"] == pytest.approx(6e-4)
    assert isinstance(cfg.optimizer.optimizer.params["eps"], float)
    assert cfg.deepspeed.zero_optimization == {"stage": 1, "overlap_comm": True}


def test_later_files_override_and_are_reported(tmp_path):
    a = write(tmp_path, "a.yml", "hidden_size: 64\nnum_layers: 2\n")
    b = write(tmp_path, "b.json", json.dumps({"hidden-size": 128, "seed": 7}))
    loaded = load_config([a, b])
    assert loaded.config.model.hidden_size == 128
    assert loaded.config.model.num_layers == 2
    assert loaded.config.training.seed == 7
    [override] = loaded.overrides
    assert (override.key, override.old, override.new) == ("hidden_size", 64, 128)
    assert "a.yml" in str(override) and "b.json" in str(override)
    assert loaded.source_of("seed").endswith("b.json")


def test_conf_dir_prefixes_names(tmp_path):
    write(tmp_path, "model.yml", "num_layers: 3\n")
    assert load_config(["model.yml"], conf_dir=str(tmp_path)).config.model.num_layers == 3


def test_unknown_key_suggests_the_right_one(tmp_path):
    path = write(tmp_path, "typo.yml", "hiden_size: 64\n")
    with pytest.raises(
        ConfigError, match=r"typo.yml: unknown config key 'hiden_size'.*'hidden_size'"
    ):
        load_config([path])


def test_unimplemented_feature_is_named(tmp_path):
    path = write(tmp_path, "mup.yml", "use_mup: true\n")
    with pytest.raises(ConfigError, match=r"mup.yml: use_mup=True .*muP"):
        load_config([path])


def test_unsupported_attention_type_is_named():
    with pytest.raises(ConfigError, match="sparse_fixed.*not implemented"):
        load_dict({"num_layers": 2, "attention_config": [[["sparse_fixed"], 2]]})


def test_type_errors_name_file_key_and_value(tmp_path):
    path = write(tmp_path, "bad.yml", "num_layers: many\n")
    with pytest.raises(ConfigError, match=r"bad.yml: num_layers='many'"):
        load_config([path])


def test_cross_field_error_names_the_fix(tmp_path):
    path = write(tmp_path, "heads.yml", "hidden_size: 96\nnum_attention_heads: 5\n")
    with pytest.raises(
        ConfigError, match=r"heads.yml: hidden_size=96 is not divisible by num_attention_heads=5"
    ):
        load_config([path])


def test_derive_errors_name_the_files_that_set_their_keys(tmp_path):
    model = write(tmp_path, "model.yml", "num_attention_heads: 4\ngradient_accumulation_steps: 2\n")
    setup = write(tmp_path, "setup.yml", "model_parallel_size: 3\ntrain_batch_size: 6\n")
    loaded = load_config([model, setup])
    with pytest.raises(ConfigError) as layout:
        derive(loaded.config, 3)
    assert str(loaded.explain(layout.value)) == (
        f"{model}, {setup}: num_attention_heads=4 is not divisible by model_parallel_size=3; "
        "use model_parallel_size 1, 2 or 4"
    )
    with pytest.raises(ConfigError) as batch:
        derive(loaded.config.model_copy(update={"parallel": ParallelConfig()}), 4)
    assert str(loaded.explain(batch.value)).startswith(
        f"{model}, {setup}: train_batch_size=6 is not divisible by gradient_accumulation_steps=2 x "
        "data-parallel size 4 = 8;"
    )


@pytest.mark.parametrize(
    "flat, message",
    [
        ({"seq_length": 4096, "max_position_embeddings": 2048}, "exceeds max_position_embeddings"),
        ({"rotary_pct": 1.5}, r"rotary_pct=1.5 must be <= 1.0 \(allowed: \(0, 1\]\)"),
        ({"num_attention_heads": 4, "num_kv_heads": 3}, "not divisible by num_kv_heads=3"),
        ({"split": "a,b"}, "split .a,b. must be up to three comma-separated numbers"),
        ({"train_data_paths": ["a"], "train_data_weights": [1.0, 2.0]}, "one weight per path"),
        ({"hidden_dropout": 1.5}, r"hidden_dropout=1.5 must be < 1.0 \(allowed: \[0, 1\)\)"),
        ({"launcher": "ssh"}, "launcher"),
    ],
)
def test_validation_errors(flat, message):
    with pytest.raises(ConfigError, match=message):
        load_dict(flat)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([str(tmp_path / "nope.yml")])


def test_duplicate_key_in_one_file(tmp_path):
    path = write(tmp_path, "dup.yml", "hidden_size: 64\nhidden-size: 128\n")
    with pytest.raises(ConfigError, match="appears twice"):
        load_config([path])


def test_runtime_keys_of_gpt_neox_are_ignored():
    cfg = load_dict({"local_rank": 3, "world_size": 8, "hidden_size": 64})
    assert cfg.model.hidden_size == 64


def _alias_bomb(levels: int, width: int = 10) -> str:
    """A few hundred bytes of YAML whose aliases expand to width**levels strings."""
    lines = [f"l0: &l0 [{', '.join(['x'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_one_line_before_it_expands(tmp_path):
    """Issue 33 (defect 7): 9 levels of 10 aliases (1e9 strings in ~600 bytes) drove --dry-run
    to gigabytes and a MemoryError; now the expanded size is counted on the parsed nodes first."""
    path = write(tmp_path, "bomb.yml", _alias_bomb(9))
    with pytest.raises(ConfigError) as e:
        load_config([str(path)])
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    assert "aliases expand to more than" in message, message


def test_a_few_yaml_aliases_still_load(tmp_path):
    """Anchors and merge keys of an ordinary config stay accepted."""
    path = write(
        tmp_path,
        "anchors.yml",
        "optimizer: &opt {type: Adam, params: {lr: 0.001}}\n"
        "zero_optimization: {stage: 1}\n"
        "attention_config: &layers [[[global], 2]]\n",
    )
    cfg = load_config([str(path)]).config
    assert cfg.optimizer.optimizer.params["lr"] == 0.001
