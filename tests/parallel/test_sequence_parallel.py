"""Sequence parallelism (sequence_parallel with model_parallel_size > 1): the sequence
collectives and a sharded model's gradients on real gloo ranks, the config's refusals, the
memory estimate and the dry run in process, and train.py against tensor parallelism without it.
The DeepSpeed-engine layouts (ZeRO 0-3, PP2 x TP2, DP2 x TP2, compiled blocks, activation
checkpointing) are cases of tests/parallel/test_equivalence.py."""

from __future__ import annotations

import pytest

from neox.config import derive, load_dict
from neox.config.errors import ConfigError
from tests.parallel.rank_helpers import run_ranks
from tests.parallel.sequence_helpers import check_sequence_ranks
from tests.train_helpers import SHORT_RUN, losses, make_dataset, run_here, write_config


@pytest.mark.slow
def test_collectives_and_gradients_on_two_ranks():
    """The three sequence collectives equal their definitions and their backward is their
    adjoint; a block makes the collectives the design says and compiles without a graph
    break; the column-parallel linears save this rank's chunk of their input; a
    GPT-NeoX (learned positions, tied head), a Pythia-style (parallel residual,
    biases) and a Llama-style model (RMSNorm, SwiGLU, GQA, rotary, untied head) give the plain
    model's loss and gradients at tp 2, the norms' and row-parallel biases' included (each
    rank saw half the tokens: the hook's all-reduce makes them whole)."""
    run_ranks(check_sequence_ranks, 2, ["A", "B", "C", "tied_qk_alibi"])


def _config(**keys):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=64)
    base.update(max_position_embeddings=64, tokenizer_type="CharLevelTokenizer")
    return load_dict({"sequence_parallel": True, "model_parallel_size": 2, **base, **keys})


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"seq_length": 63}, "needs seq_length divisible by it"),
        ({"context_parallel_size": 2}, "context_parallel_size=2"),
        ({"moe_num_experts": 4}, "moe_num_experts=4"),
        ({"lora_rank": 8}, "lora_rank=8"),
        (
            {
                "train_impl": "dpo",
                "dataset_impl": "pairwise",
                "pos_train_data_paths": ["chosen"],
                "neg_train_data_paths": ["rejected"],
            },
            "train_impl='dpo'",
        ),
    ],
)
def test_what_it_cannot_shard_is_refused_by_name(keys, message):
    with pytest.raises(ConfigError, match="sequence_parallel: true with model_parallel_size=2"):
        _config(**keys)
    with pytest.raises(ConfigError, match=message):
        _config(**keys)


def test_off_at_tensor_parallel_one():
    """One rank's chunk is the whole sequence: accepted, and nothing is split."""
    from neox.config.ds_config import build_ds_config
    from neox.plan.memory import training_shape

    cfg = _config(model_parallel_size=1, seq_length=63, pipe_parallel_size=2)
    d = derive(cfg, 2, 256)
    assert not training_shape(cfg, d, 256).sp
    assert "pipeline" not in build_ds_config(cfg, d)


def test_it_turns_partition_activations_off():
    """A block input already is this rank's chunk; DeepSpeed would mix the ranks' chunks."""
    from neox.config.ds_config import build_ds_config
    from neox.plan.memory import training_shape

    for sp in (True, False):
        cfg = _config(sequence_parallel=sp, checkpoint_activations=True, partition_activations=True)
        d = derive(cfg, 2, 256)
        assert build_ds_config(cfg, d)["activation_checkpointing"]["partition_activations"] != sp
        assert training_shape(cfg, d, 256).partition_activations != sp


def test_estimate_counts_a_chunk_between_the_linears():
    """At tp 2 the norms', dropout's, block inputs' and column-parallel linears' saved inputs
    halve; the attention and MLP shards do not; the dry run's layout line says so (the rank
    test checks the bytes saved against a real block's)."""
    from neox.plan.memory import estimate_memory, training_shape
    from neox.plan.report import estimate_report

    def activations(sp: bool, **keys):
        cfg = _config(sequence_parallel=sp, hidden_dropout=0.1, **keys)
        d = derive(cfg, 2, 256)
        return estimate_memory(cfg.model, training_shape(cfg, d, 256)).activations

    for keys in ({}, {"checkpoint_activations": True}, {"norm": "rmsnorm"}):
        on, off = activations(True, **keys), activations(False, **keys)
        assert off * 0.5 < on < off, keys
    cfg = _config()
    report = estimate_report(cfg, derive(cfg, 2, 256), 256)
    assert "tp 2 (sequence parallel: 32 tokens between layers)" in report


def test_pipeline_stages_send_whole_chunks():
    from neox.config.ds_config import SEQUENCE_PARALLEL_PIPELINE, build_ds_config

    cfg = _config(pipe_parallel_size=2)
    assert build_ds_config(cfg, derive(cfg, 4, 256))["pipeline"] == SEQUENCE_PARALLEL_PIPELINE
    cfg = _config(pipe_parallel_size=2, sequence_parallel=False)
    assert "pipeline" not in build_ds_config(cfg, derive(cfg, 4, 256))
    # A pipeline section of the user's keeps its other keys; partitioning back on is refused.
    extra = {"pipeline": {"activation_checkpoint_interval": 1}}
    cfg = _config(pipe_parallel_size=2, deepspeed_extra_args=extra)
    pipeline = build_ds_config(cfg, derive(cfg, 4, 256))["pipeline"]
    assert pipeline == {"activation_checkpoint_interval": 1, **SEQUENCE_PARALLEL_PIPELINE}
    cfg = _config(
        pipe_parallel_size=2, deepspeed_extra_args={"pipeline": {"pipe_partitioned": True}}
    )
    with pytest.raises(ConfigError, match="pipe_partitioned.*sequence_parallel: true"):
        build_ds_config(cfg, derive(cfg, 4, 256))


@pytest.mark.slow
def test_train_losses_equal_tensor_parallel_and_the_checkpoint_loads_for_eval(tmp_path):
    """train.py at tp 2 with sequence_parallel steps the losses of tp 2 without it (fp32, within
    1e-4), and eval.py's loader (whose model has no tensor or sequence parallelism) reads its
    checkpoint: the weights of the run without it, within fp32 rounding."""
    import torch

    from neox.inference.evaluation import load_eval_model

    make_dataset(tmp_path / "data" / "chars", docs=120)
    run = dict(
        SHORT_RUN,
        model_parallel_size=2,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        checkpoint_factor=SHORT_RUN["train_iters"],
    )
    weights = {}
    for name, sp in (("tp2", False), ("tp2_sp", True)):
        ckpt = str(tmp_path / name / "ckpt")
        keys = dict(run, sequence_parallel=sp, save=ckpt, load=ckpt)
        cfg = write_config(tmp_path, name, **keys)
        r = run_here("train.py", cfg)
        out = r.stdout + r.stderr
        assert ("sequence parallel: 16 of 32 tokens" in out) == sp, out[-3000:]
        model, _ = load_eval_model(ckpt, None, torch.device("cpu"), torch.float32)
        weights[name] = model.state_dict()
    want, got = losses(tmp_path / "tp2" / "logs"), losses(tmp_path / "tp2_sp" / "logs")
    assert len(got) == SHORT_RUN["train_iters"]
    assert got == pytest.approx(want, abs=1e-4, rel=0)
    assert weights["tp2_sp"].keys() == weights["tp2"].keys()
    for key, value in weights["tp2_sp"].items():
        torch.testing.assert_close(value, weights["tp2"][key], rtol=1e-4, atol=1e-5, msg=key)
