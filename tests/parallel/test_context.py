"""Context parallelism (neox/parallel/context.py): the chunking, the layout's groups, the
config's rules in process; on real gloo ranks the Ulysses exchange gives the one-process
model's loss and gradients; and train.py with context_parallel_size: 2 steps the same losses as
one rank on the same global batch, with and without packed documents. The GPU variants run the
same checks on CUDA ranks at cp 2 (`-m gpu`, 2 GPUs) and cp 4 (`-m multigpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neox.config import derive, load_dict
from neox.config.errors import ConfigError
from neox.data.batch import build_batch
from neox.parallel.context import context_chunk
from neox.parallel.topology import Topology
from tests.parallel.context_helpers import (
    CASES,
    CHUNKED,
    check_case,
    check_compiled_block,
    check_overlapped_order,
)
from tests.parallel.rank_helpers import run_ranks
from tests.train_helpers import (
    SHORT_RUN,
    TWO_GPUS,
    losses,
    make_dataset,
    run_deepy,
    run_here,
    write_config,
)


def test_chunks_keep_global_positions_and_whole_documents():
    """Positions and documents come from the whole sequence: the chunks put back together are
    the whole batch, the second chunk's positions continue the first's document."""
    text = torch.tensor([[5, 6, 0, 7, 8, 9, 10, 11, 0]])  # documents of 3 and 6 tokens
    whole = build_batch(text, 0, reset_position_ids=True, reset_attention_mask=True)
    parts = [context_chunk(whole, r, 2) for r in range(2)]
    for field in ("tokens", "labels", "loss_mask", "position_ids"):
        joined = torch.cat([getattr(p, field) for p in parts], dim=1)
        assert torch.equal(joined, getattr(whole, field)), field
    assert parts[1].position_ids.tolist() == [[1, 2, 3, 4]]  # its document began in chunk 0
    assert parts[1].document_ids is whole.document_ids  # attention sees the whole sequence
    with pytest.raises(ValueError, match="context_parallel_size=3"):
        context_chunk(whole, 0, 3)


def test_layout_groups():
    """tp 2 x cp 2 x dp 2: tensor peers adjacent, context peers next, gradients over d x c."""
    topo = Topology(tp=2, dp=2, cp=2)
    assert [tuple(topo.coord(r)) for r in (0, 1, 2, 5)] == [
        (0, 0, 0, 0),
        (0, 0, 1, 0),
        (0, 0, 0, 1),
        (0, 1, 1, 0),
    ]
    assert topo.tensor_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.context_group_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.data_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.gradient_group_ranks() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert all(topo.rank(*topo.coord(r)) == r for r in range(topo.world_size))


def _config(**keys):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=64)
    base.update(max_position_embeddings=64, tokenizer_type="CharLevelTokenizer")
    return load_dict({**base, **keys})


def test_data_parallel_ranks_are_what_tp_pp_and_cp_leave():
    d = derive(_config(context_parallel_size=2, model_parallel_size=2), 8, 256)
    assert (d.data_parallel, d.context_parallel, d.tensor_parallel) == (2, 2, 2)


@pytest.mark.parametrize(
    "keys, world, message",
    [
        ({"context_parallel_size": 3}, 6, "num_attention_heads / model_parallel_size = 8"),
        ({"context_parallel_size": 4, "model_parallel_size": 4}, 16, "is not divisible by"),
        ({"context_parallel_size": 2, "seq_length": 63}, 2, "seq_length=63"),
        ({"context_parallel_size": 2, "pipe_parallel_size": 2}, 4, "pipe_parallel_size=2"),
        ({"context_parallel_size": 4}, 6, "x context_parallel_size=4 = 4"),
    ],
)
def test_layouts_it_cannot_split_are_refused_by_name(keys, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        derive(_config(**keys), world, 256)


def test_preference_objectives_are_refused():
    with pytest.raises(ValueError, match="context_parallel_size=2 with train_impl='dpo'"):
        _config(
            context_parallel_size=2,
            train_impl="dpo",
            dataset_impl="pairwise",
            pos_train_data_paths=["chosen"],
            neg_train_data_paths=["rejected"],
        )


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"context_parallel_chunks": 3}, "context_parallel_chunks=3 does not divide the 4 heads"),
        ({"context_parallel_chunks": 4, "model_parallel_size": 2}, "model_parallel_size=2 / "),
        ({"context_parallel_chunks": 0}, "context_parallel_chunks"),
    ],
)
def test_head_groups_that_cut_heads_are_refused_by_name(keys, message):
    with pytest.raises(ConfigError, match=message) as e:
        _config(context_parallel_size=2, **keys)
    if keys["context_parallel_chunks"]:
        assert "context_parallel_size=2" in str(e.value)
        assert "use context_parallel_chunks 1" in str(e.value)


def test_head_groups_are_read_only_under_context_parallelism():
    """A config that sets context_parallel_chunks for its CP layouts also runs without CP."""
    d = derive(_config(context_parallel_chunks=3), 1, 256)
    assert d.context_parallel == 1


def _check_cases(rank: int, world: int, cases: list[tuple[str, int, dict]]) -> None:
    for name, chunks, keys in cases:
        check_case(rank, world, name, chunks, keys)


@pytest.mark.slow
def test_ulysses_gives_the_one_process_loss_and_gradients():
    """Two gloo ranks, every case of context_helpers.CASES (packed documents with GQA and a
    sliding window, MQA with replicated kv heads and ALiBi, scaled rotary with a masked SFT
    prompt, plain): loss and every gradient equal the whole batch's in one process; with the
    exchange in 2, 3 and 4 head groups (context_helpers.CHUNKED) they also equal one group's."""
    run_ranks(_check_cases, 2, [(name, 1, {}) for name in CASES] + CHUNKED)


@pytest.mark.slow
def test_compiled_block_traces_the_exchange():
    """Two gloo ranks: a compiled transformer block has no graph break at the all-to-all,
    matches the eager block, and a layer makes two all-to-alls each way (context_helpers), or
    four in two head groups, whose AOTAutograd graphs keep the overlapped order."""
    run_ranks(check_compiled_block, 2)


@pytest.mark.slow
def test_head_groups_overlap_the_kernel():
    """Two gloo ranks, a block's exchange in 2 head groups: the second group's q, k, v leave
    before the first group's kernel and the first group's output before the second's kernel,
    each waited for after that kernel; the backward mirrors it; eagerly and in the code
    inductor generates with compile_blocks' comm-reordering passes (context_helpers)."""
    run_ranks(check_overlapped_order, 2)


# ---- train.py end to end: CP ranks against one rank on the same global batch ----

DEVICES = [
    pytest.param("cpu", 2, marks=pytest.mark.slow, id="cpu-cp2"),
    pytest.param("cuda", 2, marks=[pytest.mark.gpu, TWO_GPUS, pytest.mark.slow], id="cuda-cp2"),
    pytest.param("cuda", 4, marks=[pytest.mark.multigpu, pytest.mark.slow], id="cuda-cp4"),
]
PACKED = {
    # Documents packed in each sample, kept apart, GQA and a sliding window; DeepSpeed's engine.
    True: dict(
        reset_attention_mask=True,
        reset_position_ids=True,
        num_kv_heads=2,
        sliding_window_width=8,
        flat_engine=False,
    ),
    # Plain causal sequences; neox's flat engine (ZeRO-1).
    False: {},
}
# Beside cp alone, on 4 ranks: data parallelism (plain; the flat engine's gradients reduced in
# buckets during the backward, overlap_comm; the exchange in 2 head groups of one head) or
# tensor parallelism (packed, where each tensor-parallel rank's one kv head is replicated over
# the context-parallel ranks).
OVERLAP = {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 2000}
COMPOSED = {
    False: (
        "cp2_dp2",
        {
            "num_gpus": 4,
            "gradient_accumulation_steps": 1,
            "zero_optimization": OVERLAP,
            "context_parallel_chunks": 2,
        },
    ),
    True: ("tp2_cp2", {"num_gpus": 4, "model_parallel_size": 2}),
}


def _losses(tmp: Path, name: str, device: str, keys: dict) -> dict[int, float]:
    run = dict(
        SHORT_RUN,
        num_gpus=keys.get("context_parallel_size", 1),
        seq_length=64,
        max_position_embeddings=64,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        make_vocab_size_divisible_by=256,  # one padded vocabulary at tp 1 and 2
        torch_compile=False,  # on GPUs too: layouts are compared, not kernels
    )
    if device == "cuda":
        run["hidden_size"] = 64  # FlexAttention's CUDA kernels take heads of 16 and wider

    cfg = write_config(tmp, name, **{**run, **keys})
    if device == "cpu":
        run_here("train.py", cfg)
    else:
        run_deepy("train.py", cfg, cpu=False)
    return losses(tmp / name / "logs")


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("device, cp", DEVICES)
def test_train_losses_equal_one_rank(tmp_path, device, cp, packed):
    """Per-step losses at context_parallel_size cp (and, on 2 CPU ranks or 4 GPUs, cp 2 beside
    dp 2, its exchange in 2 head groups, or beside tp 2) equal one rank's within 1e-4 (fp32)."""
    make_dataset(tmp_path / "data" / "chars", docs=120)
    keys = PACKED[packed]
    one = _losses(tmp_path, "one", device, keys)
    assert len(one) == SHORT_RUN["train_iters"]
    assert one[5] < one[1]  # it trains
    runs = {f"cp{cp}": {"context_parallel_size": cp}}
    if device == "cpu" or cp == 4:
        name, layout = COMPOSED[packed]
        runs[name] = {"context_parallel_size": 2, **layout}
    for name, layout in runs.items():
        split = _losses(tmp_path, name, device, {**keys, **layout})
        assert split == pytest.approx(one, abs=1e-4, rel=0), name


def test_estimate_counts_one_chunk_of_activations_per_rank():
    """Activations of cp=2 are half of cp=1's on the same per-rank batch
    (a chunk of tokens; the whole sequence for half the heads in attention); ZeRO partitions
    over data x context."""
    from neox.plan.memory import estimate_memory, training_shape

    def estimate(cp: int):
        cfg = _config(context_parallel_size=cp, num_kv_heads=2, zero_optimization={"stage": 1})
        shape = training_shape(cfg, derive(cfg, cp, 256), 256)
        return shape, estimate_memory(cfg.model, shape)

    (one_shape, one), (two_shape, two) = estimate(1), estimate(2)
    assert (one_shape.dp, two_shape.dp, two_shape.cp) == (1, 2, 2)
    assert two.activations * 2 == one.activations
    assert two.logits < one.logits  # the chunk's logits (the head weight's gradient stays)
    assert two.optimizer_states < one.optimizer_states  # ZeRO-1 over the two ranks


def test_dry_run_names_each_layers_collective():
    from neox.plan.attention_path import describe_attention_paths

    cfg = _config(num_kv_heads=2).model
    (plain,) = describe_attention_paths(cfg)
    (line,) = describe_attention_paths(cfg, tp=2, cp=2)
    assert "context parallel" not in plain
    assert "context parallel over 2 ranks: Ulysses all-to-all" in line
    assert "2 query heads and 2 kv heads (the 1 kv heads replicated" in line
    assert "groups" not in line
    (grouped,) = describe_attention_paths(cfg, cp=2, chunks=2)
    assert grouped.endswith(
        "the exchange in 2 groups of 2 query heads, each group's kernel "
        "between its own q, k, v transfer and its output's"
    )
