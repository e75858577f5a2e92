import math
import re
from pathlib import Path

import pytest

from neox.config import ConfigError, ModelConfig, derive, load_dict, pad_vocab_size
from neox.config.derived import batch_triple, consumed_samples, precision_of
from neox.config.shape import ModelShape

ROOT = Path(__file__).resolve().parents[2]


def test_pad_vocab_size_rounds_to_tp_multiple():
    assert pad_vocab_size(50277, 128, 2) == 50432  # GPT-NeoX-20B's padded vocab
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(512, 128, 4) == 512


@pytest.mark.parametrize(
    "keys, dp, triple",
    [
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (4, 2, 24)),
        ({"train_micro_batch_size_per_gpu": 4, "train_batch_size": 32}, 2, (4, 4, 32)),
        ({"gradient_accumulation_steps": 2, "train_batch_size": 32}, 4, (4, 2, 32)),
        ({"train_batch_size": 16}, 4, (4, 1, 16)),
        ({"train_micro_batch_size_per_gpu": 8}, 2, (8, 1, 16)),
        ({"batch_size": 8}, 1, (8, 1, 8)),
        ({}, 2, (1, 1, 2)),
    ],
)
def test_any_two_of_the_batch_triple_give_the_third(keys, dp, triple):
    assert batch_triple(load_dict(keys), dp) == triple


def test_inconsistent_batch_triple_is_an_error():
    cfg = load_dict(
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "train_batch_size": 30,
        }
    )
    with pytest.raises(ConfigError, match=r"train_batch_size=30 != .* = 16"):
        batch_triple(cfg, 2)


def test_indivisible_global_batch_is_an_error():
    with pytest.raises(ConfigError, match="not divisible"):
        batch_triple(load_dict({"train_micro_batch_size_per_gpu": 3, "train_batch_size": 10}), 1)


def test_derive_layout_and_vocab():
    cfg = load_dict(
        {
            "model_parallel_size": 2,
            "pipe_parallel_size": 2,
            "num_layers": 4,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 3,
            "bf16": {"enabled": True},
        }
    )
    d = derive(cfg, world_size=8, vocab_size=1000)
    assert (d.tensor_parallel, d.pipe_parallel, d.data_parallel) == (2, 2, 2)
    assert d.global_batch == 2 * 3 * 2
    assert d.padded_vocab_size == 1024
    assert d.precision == "bf16"


def test_world_not_divisible_by_model_parallel():
    cfg = load_dict({"model_parallel_size": 2, "pipe_parallel_size": 2, "num_layers": 4})
    with pytest.raises(
        ConfigError,
        match=r"world size 6 is not divisible by model_parallel_size=2 x pipe_parallel_size=2",
    ):
        derive(cfg, world_size=6)


def test_heads_not_divisible_by_tensor_parallel_names_options():
    cfg = load_dict({"hidden_size": 96, "num_attention_heads": 12, "model_parallel_size": 8})
    with pytest.raises(
        ConfigError,
        match=r"num_attention_heads=12 is not divisible by model_parallel_size=8; use model_parallel_size 1, 2, 3, 4, 6 or 12",
    ):
        derive(cfg, world_size=8)


def test_layers_fewer_than_stages():
    cfg = load_dict({"num_layers": 2, "pipe_parallel_size": 4})
    with pytest.raises(ConfigError, match="num_layers=2 is smaller than pipe_parallel_size=4"):
        derive(cfg, world_size=4)


def test_pinned_padded_vocab_must_cover_tokenizer():
    cfg = load_dict({"padded_vocab_size": 500})
    with pytest.raises(ConfigError, match="smaller than the tokenizer"):
        derive(cfg, world_size=1, vocab_size=512)
    assert derive(load_dict({"padded_vocab_size": 640}), 1, 512).padded_vocab_size == 640


def test_precision_sources_must_agree():
    assert precision_of(load_dict({"fp16": {"enabled": True}})) == "fp16"
    assert precision_of(load_dict({"precision": "bfloat16"})) == "bf16"
    assert precision_of(load_dict({})) == "fp32"
    with pytest.raises(ConfigError, match="both enabled"):
        precision_of(load_dict({"fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    with pytest.raises(ConfigError, match="contradicts"):
        precision_of(load_dict({"fp16": {"enabled": True}, "precision": "bfloat16"}))


def test_fp16_section_of_type_bfloat16_is_bf16():
    """gpt-neox's spelling of bf16 (configs/pythia/1B.yml): DeepSpeed gets a bf16 section, never
    its fp16 section with a `type` key it refuses."""
    from neox.config import build_ds_config

    cfg = load_dict({"fp16": {"enabled": True, "type": "bfloat16", "loss_scale": 0}})
    assert precision_of(cfg) == "bf16"
    ds = build_ds_config(cfg, derive(cfg, 1))
    assert ds["bf16"]["enabled"] and "fp16" not in ds


def test_schedule_iterations():
    d = derive(load_dict({"train_iters": 1000, "warmup": 0.1}), 1)
    assert (d.lr_decay_iters, d.warmup_iters) == (1000, 100)
    d = derive(load_dict({"train_iters": 1000, "lr_decay_iters": 500, "warmup": 0.01}), 1)
    assert (d.lr_decay_iters, d.warmup_iters) == (500, 5)


def test_fp32_pipeline_clipping_without_zero_is_accepted():
    """DeepSpeed's wrong norm is worked around in the adapter (tests/parallel/
    test_stock_layouts.py trains it against one rank), so the stock fp32 files pipeline."""
    derive(load_dict({"pipe_parallel_size": 2, "num_layers": 2, "gradient_clipping": 1.0}), 2)


def test_pipeline_refuses_per_document_masks():
    flat = {"pipe_parallel_size": 2, "num_layers": 2, "reset_attention_mask": True, "zero_stage": 1}
    with pytest.raises(ConfigError, match="reset_attention_mask cannot be used with pipe"):
        derive(load_dict(flat), 2)


def test_per_split_paths_must_cover_the_splits_a_run_evaluates():
    paths = {"train_data_paths": ["a"], "valid_data_paths": ["b"]}
    with pytest.raises(ConfigError, match="test_data_paths is not.*or set do_test: false"):
        derive(load_dict(paths), 1)
    derive(load_dict({**paths, "do_test": False}), 1)
    derive(load_dict({**paths, "test_data_paths": ["c"]}), 1)
    with pytest.raises(ConfigError, match="valid_data_paths is not"):
        derive(load_dict({"train_data_paths": ["a"], "do_test": False}), 1)


def test_a_resumed_run_continues_within_the_samples_the_run_draws():
    cfg = load_dict({"train_iters": 10, "eval_interval": 4, "eval_iters": 2, "train_batch_size": 8})
    d = derive(cfg, 1)
    assert consumed_samples(cfg, d.global_batch, 9) == (9 * 8, 2 * 2 * 8)  # validated at 4, 8
    for iteration in range(11):
        train, valid = consumed_samples(cfg, d.global_batch, iteration)
        assert train <= d.samples[0] and valid + 2 * 8 <= d.samples[1]  # room for the next pass
    quiet = load_dict({"train_iters": 10, "do_valid": False})
    assert consumed_samples(quiet, 8, 9)[1] == 0


def test_sample_counts_cover_training_and_every_evaluation():
    cfg = load_dict({"train_iters": 10, "eval_interval": 4, "eval_iters": 2, "train_batch_size": 8})
    assert derive(cfg, 1).samples == (80, (10 // 4 + 1) * 2 * 8, 2 * 8)
    quiet = load_dict({"train_iters": 10, "do_valid": False, "do_test": False})
    assert derive(quiet, 1).samples[1:] == (0, 0)


def test_model_shape_as_gpt_neox_derives_it():
    gqa = load_dict({"hidden_size": 96, "num_attention_heads": 6, "num_kv_heads": 2,
                     "activation": "swiglu", "mlp_multiple_of": 32, "rotary_pct": 0.25,
                     "pos_emb": "rotary", "seq_length": 64, "max_position_embeddings": 256,
                     "opt_pos_emb_offset": 2, "num_layers": 4,
                     "attention_config": [[["global", "local"], "all"]],
                     "sliding_window_width": 16})  # fmt: skip
    shape = gqa.model.shape
    # Gated: 2/3 of 4 x 96 = 256 per two branches -> 128, already a multiple of 32.
    assert shape == ModelShape(
        head_dim=16,
        kv_heads=2,
        ffn_size=128,
        gated_mlp=True,
        rotary_dims=4,
        max_positions=256,
        position_rows=258,
        layer_types=("global", "local") * 2,
    )
    assert derive(gqa, 1).model == shape  # a run's Derived carries the same shape
    plain = load_dict({"hidden_size": 64, "expansion_factor": 2.5}).model.shape
    assert (plain.ffn_size, plain.kv_heads, plain.max_positions) == (160, 4, 128)


# Each derived value's formula as it would look written again outside the modules that derive:
# neox/config/derived.py (the run's values), the model's shape (shape.py, and model.py, which
# builds it from ModelConfig's keys) and the ZeRO stage (DeepSpeedConfig.stage).
DERIVING = {
    "neox/config/derived.py",
    "neox/config/shape.py",
    "neox/config/model.py",
    "neox/config/deepspeed.py",
}
RECOMPUTED = {
    "head_dim": r"hidden_size\s*//",
    "kv_heads": r"\.num_kv_heads\s+or\b",
    "max_positions": r"\.max_position_embeddings\s+or\b",
    "ffn_size": r"\.intermediate_size\s+or\b|expansion_factor\s*\*|\*\s*[\w.]*expansion_factor",
    "rotary_dims": r"int\(.*rotary_pct",
    "gated_mlp": r"in\s*\(\s*[\"']swiglu[\"']",
    "layer_types": r"\.attention_config\b",
    "precision": r"\.(?:fp16|bf16)(?:\.get\(|\s+is\s+not\s+None)",
    "optimizer_type": r"\.optimizer\.type\b|(?<![Dd]erived)\.optimizer_type\b",
    "lr": r"\.optimizer\.lr\b",
    "schedule": r"(?<!derived)\.lr_decay_(?:iters|fraction)\b|\b(?:o|optimizer)\.warmup\b",
    "batch triple": r"\.(?:train_micro_batch_size_per_gpu|gradient_accumulation_steps)\b",
    "padded vocab": r"\.make_vocab_size_divisible_by\b",
    "zero stage": r"zero_optimization\s+or\s+\{\}\s*\)\.get\(|\.zero_stage\s+or\b",
    "resume position": r"//\s*[\w.]*eval_interval",
}


@pytest.mark.parametrize("value", list(RECOMPUTED))
def test_derived_values_are_computed_only_in_derived(value):
    """Model, loop, optimizer, tools and benchmarks read Derived or ModelConfig.shape; a second copy
    of a formula drifts (memory.py once took optimizer.type's Adam default over sgd)."""
    pattern = re.compile(RECOMPUTED[value])
    files = [*ROOT.glob("neox/**/*.py"), *ROOT.glob("*.py"), *ROOT.glob("tools/*.py")]
    files += ROOT.glob("benchmarks/*.py")
    hits = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in files
        if path.relative_to(ROOT).as_posix() not in DERIVING
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, f"{value} is worked out again at {hits}; use neox.config.derived instead"
    assert not hasattr(ModelConfig, value), f"ModelConfig.{value}: derived values live apart"


def test_the_model_shape_is_computed_once_and_carried():
    """Only check_model (ModelConfig's validation) calls model_shape; every other module reads
    `.shape`, which follows the config through assignment and validated copies."""
    pattern = re.compile(r"\bmodel_shape\(")
    files = [*ROOT.glob("neox/**/*.py"), *ROOT.glob("*.py"), *ROOT.glob("tools/*.py")]
    files += [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("tests/**/*.py")]
    callers = sorted(
        str(path.relative_to(ROOT))
        for path in files
        if path.name != "test_derived.py" and pattern.search(path.read_text())
    )
    assert callers == ["neox/config/model.py"], callers
    model = (ROOT / "neox/config/model.py").read_text()
    assert len(pattern.findall(model)) == 2, "model_shape: its definition and check_model's call"
    m = load_dict({"hidden_size": 64, "num_attention_heads": 4}).model
    assert m.shape.head_dim == 16
    m.num_attention_heads = 8
    assert m.shape.head_dim == 8
    longer = m.model_copy(update={"seq_length": 256, "max_position_embeddings": 512})
    assert (longer.shape.max_positions, m.shape.max_positions) == (512, 128)
    with pytest.raises(ValueError, match="not divisible"):
        m.model_copy(update={"num_attention_heads": 5})


ROTARY = dict(pos_emb="rotary", seq_length=64)


def test_rope_scaling_mapping_equals_the_flat_keys():

    flat = ModelConfig(
        **ROTARY,
        rope_scaling_type="llama3",
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position_embeddings=16,
    )
    nested = ModelConfig(
        **ROTARY,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    assert flat.shape.rope == nested.shape.rope
    assert flat.shape.rope.original_max_positions == 16
    # yarn's defaults, as transformers resolves them: factor from the lengths, 0.1 ln(f) + 1.
    yarn = ModelConfig(**ROTARY, rope_scaling_type="yarn", rope_original_max_position_embeddings=16)
    assert yarn.shape.rope.factor == 4.0
    assert yarn.shape.rope.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    assert (yarn.shape.rope.beta_fast, yarn.shape.rope.beta_slow) == (32.0, 1.0)


@pytest.mark.parametrize(
    "keys,words",
    [
        (dict(rope_scaling_type="llama3", rope_scaling_factor=8.0), "rope_low_freq_factor"),
        (dict(rope_scaling_type="linear"), "needs rope_scaling_factor"),
        (dict(rope_scaling_factor=2.0), "rope_scaling_factor=2.0 set without rope_scaling_type"),
        (
            dict(rope_scaling_type="dynamic", rope_scaling_factor=2.0, rope_yarn_beta_fast=8.0),
            "rope_yarn_beta_fast=8.0 do not apply to rope_scaling_type='dynamic'",
        ),
        (
            dict(rope_scaling_type="linear", rope_scaling_factor=2.0, rope_scaling={"factor": 2}),
            "keep one spelling",
        ),
        (
            dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}),
            "'longrope' is not supported",
        ),
        (dict(rope_scaling={"rope_type": "linear", "factor": -1}), "factor=-1"),
        (dict(rope_scaling={"rope_type": "linear", "rope_theta": 5.0}), "rope_theta=5.0"),
        (dict(rope_scaling_type="linear", rope_scaling_factor=2.0, pos_emb="alibi"), "rotary"),
        (
            dict(
                rope_scaling_type="llama3",
                rope_scaling_factor=8.0,
                rope_low_freq_factor=4.0,
                rope_high_freq_factor=1.0,
            ),
            "must exceed",
        ),
    ],
)
def test_rope_scaling_mistakes_are_named(keys, words):

    with pytest.raises(ValueError, match=re.escape(words)):
        ModelConfig(**{**ROTARY, **keys})


def test_head_dim_and_dense_bias_shape_the_attention():

    m = ModelConfig(
        hidden_size=24, num_attention_heads=4, head_dim=16, use_bias_in_attn_dense=False
    )
    assert (m.shape.head_dim, m.shape.attn_dense_bias) == (16, False)
    assert ModelConfig(use_bias_in_attn_linear=False).shape.attn_dense_bias is False


@pytest.mark.parametrize(
    "keys,message",
    [
        ({"pipe_parallel_size": 2}, "not implemented with pipeline parallelism"),
        ({"zero_optimization": {"stage": 3}}, "not implemented with ZeRO-3"),
        ({"finetune": True}, "set lora_base to the base checkpoint"),
        ({"lora_target_modules": ["gate"]}, "has no gate linear"),
        (
            {"lora_dropout": 0.1, "attention_dropout": 0.1, "model_parallel_size": 2},
            "dropped differently per rank",
        ),
        (
            {
                "train_impl": "dpo",
                "dataset_impl": "pairwise",
                "pos_train_data_paths": ["c"],
                "neg_train_data_paths": ["r"],
                "do_valid": False,
                "do_test": False,
            },
            "not implemented for preference training",
        ),
        ({"fp8": {"enabled": True}}, "adapters on float8 linears are not implemented"),
    ],
)
def test_lora_refuses_what_it_does_not_implement_by_name(keys, message):
    base = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "lora_rank": 4}
    with pytest.raises(ConfigError, match=message):
        load_dict({**base, **keys})
    load_dict({**base, **{k: v for k, v in keys.items() if k.startswith("lora_")}, "lora_rank": 0})
