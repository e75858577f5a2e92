import pytest

from neox.config import ConfigError, derive, load_dict, pad_vocab_size
from neox.config.derived import batch_triple, precision_of


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


def test_schedule_iterations():
    d = derive(load_dict({"train_iters": 1000, "warmup": 0.1}), 1)
    assert (d.lr_decay_iters, d.warmup_iters) == (1000, 100)
    d = derive(load_dict({"train_iters": 1000, "lr_decay_iters": 500, "warmup": 0.01}), 1)
    assert (d.lr_decay_iters, d.warmup_iters) == (500, 5)


def test_fp32_pipeline_clipping_without_zero_is_refused():
    flat = {"pipe_parallel_size": 2, "num_layers": 2, "gradient_clipping": 1.0}
    with pytest.raises(ConfigError, match="use zero_optimization.stage 1"):
        derive(load_dict(flat), 2)
    derive(load_dict({**flat, "zero_optimization": {"stage": 1}}), 2)
    derive(load_dict({**flat, "gradient_clipping": 0.0}), 2)


def test_pipeline_refuses_per_document_masks():
    flat = {"pipe_parallel_size": 2, "num_layers": 2, "reset_attention_mask": True, "zero_stage": 1}
    with pytest.raises(ConfigError, match="reset_attention_mask cannot be used with pipe"):
        derive(load_dict(flat), 2)


def test_sample_counts_cover_training_and_every_evaluation():
    cfg = load_dict({"train_iters": 10, "eval_interval": 4, "eval_iters": 2, "train_batch_size": 8})
    assert derive(cfg, 1).samples == (80, (10 // 4 + 1) * 2 * 8, 2 * 8)
    quiet = load_dict({"train_iters": 10, "do_valid": False, "do_test": False})
    assert derive(quiet, 1).samples[1:] == (0, 0)
