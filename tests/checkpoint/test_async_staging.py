"""A save's host staging (issue 35): one buffer reused save to save, filled with copies (the
steps after the copy change nothing in it), and data-parallel ranks' fragments of the state read
back whole."""

import json
import logging

import pytest
import torch

from neox.checkpoint.errors import CheckpointError
from neox.checkpoint.host_staging import HostStaging
from neox.checkpoint.io import save_plain_state
from neox.checkpoint.plain_state import (
    Layout,
    PlainState,
    fragment,
    write_client_state,
    write_meta,
    write_pieces,
)
from neox.config.model import ModelConfig
from neox.model import build_model
from neox.parallel.layers import shard
from neox.training.deepspeed_engine import DeepSpeedAdapter
from neox.training.flat_engine import FlatEngine, FlatSettings
from neox.training.optim import param_groups

CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    max_position_embeddings=16,
    no_weight_tying=True,
)
VOCAB = 64


@pytest.mark.gpu
def test_the_pinned_buffer_is_exactly_the_asked_size_and_takes_asynchronous_copies():
    import threading

    from neox.checkpoint import host_staging

    cuda = torch.device("cuda", torch.cuda.current_device())
    numel = (1 << 28) + 3  # 1 GiB and 12 bytes: torch's pinned allocator would lock 2 GiB
    stats = getattr(torch.cuda, "host_memory_stats", dict)  # torch's pinned allocator's
    before = stats().get("allocated_bytes.current", 0)
    staging = HostStaging()
    done = threading.Event()
    # Allocated as prepare_save does it, off the training thread.
    threading.Thread(target=lambda: (staging.reserve(numel, cuda), done.set())).start()
    assert done.wait(120)
    buf = staging.buffer
    assert buf.numel() == numel and buf.is_pinned()
    assert buf.data_ptr() in host_staging._locked  # the driver's lock, not torch's allocator
    assert stats().get("allocated_bytes.current", 0) == before
    x = torch.randn(numel, device=cuda)
    staging.reserve(numel, cuda)
    held = staging.put(x)
    staging.wait()
    assert staging.buffer is buf and torch.equal(held, x.cpu())
    staging.reserve(numel - 1, cuda)  # another size: the old buffer unlocked, a new one locked
    assert buf.data_ptr() not in host_staging._locked and staging.buffer.is_pinned()
    host_staging.unlock(staging.buffer)


def test_the_buffer_is_reused_and_holds_copies(caplog):
    staging = HostStaging()
    a, b = torch.randn(3, 4), torch.randn(5)
    with caplog.at_level(logging.INFO, logger="neox.checkpoint.host_staging"):
        staging.reserve(a.numel() + b.numel(), torch.device("cpu"))
        held = [staging.put(a), staging.put(b)]
        staging.wait()
        first = staging.buffer
        assert not staging.buffer.is_pinned()  # CPU ranks: plain host memory
        assert [t.shape for t in held] == [a.shape, b.shape]
        assert torch.equal(held[0], a) and torch.equal(held[1], b)
        a.add_(1.0)  # the next step changes the state in place: the copy keeps the saved one
        assert not torch.equal(held[0], a)
        # The next save of the same size: the same memory, and its size said once.
        staging.reserve(a.numel() + b.numel(), torch.device("cpu"))
        assert staging.buffer is first and staging.buffer.data_ptr() == first.data_ptr()
        assert torch.equal(staging.put(a), a)
    said = [r.getMessage() for r in caplog.records if "checkpoint staging" in r.getMessage()]
    assert len(said) == 1 and "0.0 MB of plain host memory" in said[0]
    staging.reserve(2, torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit"):
        staging.put(torch.zeros(3))
    # Allocated ahead in the background; the save of that size takes it as it is.
    staging.prepare(7, torch.device("cpu"))
    staging._join()
    ahead = staging.buffer
    staging.reserve(7, torch.device("cpu"))
    assert staging.buffer is ahead and ahead.numel() == 7


def write_fragments(step_dir, full: dict, tp: int, dp: int) -> None:
    """Each (tp, dp) rank writes its data-parallel share of the flattened TP slices, split at
    uneven points (as ZeRO's partitions cut parameters)."""
    rank = 0
    for t in range(tp):
        for d in range(dp):
            pieces = []
            for name, (tensor, dim) in full.items():
                if dim is None and t > 0:
                    continue
                local = tensor if dim is None else shard(tensor, dim, t, tp)
                n = local.numel()
                lo, hi = n * d // dp + (d > 0), n * (d + 1) // dp + (d < dp - 1)
                flat = local.reshape(-1)[lo:hi]
                mine = {"fp32": flat, "exp_avg": 2 * flat}
                pieces.append(fragment(name, tuple(local.shape), lo, hi, mine, dim, t, tp))
            write_pieces(step_dir, rank, pieces)
            rank += 1
    write_client_state(step_dir, 0, {"iteration": 3})
    write_meta(step_dir, Layout("deepspeed", tp, 1, dp, 1), {"step": 3.0})


def test_fragments_of_data_parallel_ranks_read_back_whole_and_at_another_split(tmp_path):
    torch.manual_seed(0)
    rows, cols, bias = torch.randn(8, 6), torch.randn(6, 8), torch.randn(6)
    full = {"a.weight": (rows, 0), "b.weight": (cols, 1), "n.bias": (bias, None)}
    write_fragments(tmp_path, full, tp=2, dp=3)
    state = PlainState(tmp_path)
    assert torch.equal(state.read("fp32", "a.weight", (8, 6), None, 0), rows)
    assert torch.equal(state.read("exp_avg", "b.weight", (6, 8), None, 0), 2 * cols)
    assert torch.equal(state.read("fp32", "n.bias", (6,), None, 0), bias)
    for rank in range(4):  # tp=4 reads its slices from the tp=2 fragments
        got = state.read("fp32", "b.weight", (6, 2), 1, 2 * rank)
        assert torch.equal(got, shard(cols, 1, rank, 4))


def test_fragments_that_leave_a_gap_are_refused(tmp_path):
    torch.manual_seed(0)
    write_fragments(tmp_path, {"a.weight": (torch.randn(4, 3), None)}, tp=1, dp=2)
    (tmp_path / "state" / "rank_00001.json").unlink()
    (tmp_path / "state" / "rank_00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"do not cover it exactly.*incomplete"):
        PlainState(tmp_path)


@pytest.fixture(scope="module")
def rank():
    """One rank as DeepSpeed's engine wants it (tests/training/test_flat_engine.py says why)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    from neox.parallel.distributed import start_deepspeed_comm

    with pytest.MonkeyPatch.context() as mp:
        for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
            mp.setenv(name, value)
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", world_size=1, rank=0)
        start_deepspeed_comm("gloo")
        yield
        dist.destroy_process_group()
        groups._WORLD_GROUP = groups._DATA_PARALLEL_GROUP = None


@pytest.fixture
def restore_linear():
    """ZeRO-3 installs its memory-efficient linear as torch.nn.functional.linear for the
    process: put torch's back for the tests after."""
    import torch.nn.functional as F

    linear = F.linear
    yield
    F.linear = linear


def built(kind: str, stage: int):
    torch.manual_seed(0)
    model = build_model(CFG, VOCAB)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    bf16 = stage > 0
    if kind == "flat":
        return FlatEngine(
            FlatSettings(micro_batch=2, bf16=bf16, zero_stage=stage), model, opt, None
        )
    cfg = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "overlap_comm": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "bf16": {"enabled": bf16},
    }
    return DeepSpeedAdapter(cfg, model, opt, None)


def step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, VOCAB, (2, CFG.seq_length + 1), generator=g)
    ds = getattr(engine, "ds", engine)
    loss = ds(text[:, :-1], labels=text[:, 1:])
    ds.backward(loss)
    ds.step()


def state_files(step_dir) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted((step_dir / "state").glob("rank_*"))}


@pytest.mark.parametrize(
    "kind,stage",
    [("flat", 1), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 0), ("deepspeed", 3)],
    ids=["flat", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero0-fp32", "deepspeed-zero3"],
)
def test_staged_state_is_the_synchronous_save_byte_for_byte_and_reused(
    rank, restore_linear, tmp_path, kind, stage
):
    engine = built(kind, stage)
    if kind == "deepspeed":  # ZeRO-1/2 copy their flat partitions, ZeRO-3 each partition
        assert (engine._own_partitions() is not None) == (stage in (1, 2))
        assert (engine._zero3_ranges() is not None) == (stage == 3)
    step(engine, 0)
    engine.prepare_save()  # as the loop does after a saving run's first step
    step(engine, 1)
    engine.staging._join()
    prepared = engine.staging.buffer
    save_plain_state(engine, tmp_path / "sync", {"iteration": 2})
    # The save used the buffer allocated ahead (prepare_save sized it exactly).
    assert engine.staging.buffer is prepared
    # async_save's part on the training thread: the copy; the writer cuts and writes it later,
    # after the next step has changed every master weight and moment in place.
    pieces, _ = engine.plain_pieces()
    buffer = engine.staging.buffer
    step(engine, 2)
    write_pieces(tmp_path / "async", 0, pieces())
    assert state_files(tmp_path / "async") == state_files(tmp_path / "sync")
    # The next save reuses the same host memory, and holds the new step.
    save_plain_state(engine, tmp_path / "later", {"iteration": 3})
    assert engine.staging.buffer is buffer and buffer.data_ptr() == prepared.data_ptr()
    later = state_files(tmp_path / "later")
    assert later.keys() == state_files(tmp_path / "sync").keys()
    assert (
        later["rank_00000.safetensors"] != state_files(tmp_path / "sync")["rank_00000.safetensors"]
    )


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_hashes_its_state_files_as_it_writes_them(rank, tmp_path, monkeypatch, async_save):
    """The rank's state files are checksummed as they are written, never read back to hash
    them (17 GB at Pythia-1.4B); the small files are hashed once; the manifest verifies."""
    from collections import Counter

    from neox.checkpoint import io, manifest
    from neox.checkpoint.lock import acquire, release
    from neox.config import NeoXConfig

    read_back = Counter()
    hash_file = manifest.file_digest

    def counted(path):
        read_back[path.relative_to(tmp_path / "global_step2.partial").as_posix()] += 1
        return hash_file(path)

    monkeypatch.setattr(manifest, "file_digest", counted)
    cfg = NeoXConfig.from_flat(dict(save=str(tmp_path), async_save=async_save))
    engine = built("flat", 1)
    step(engine, 0)
    acquire(tmp_path)
    try:
        io.save_checkpoint(engine, cfg, 2, {"extra": 1})
        io.wait_for_saves()
    finally:
        release(tmp_path)
        monkeypatch.undo()  # the check below reads every file back, as a load does
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert manifest.manifest_problem(tmp_path / "global_step2", verify=True) is None
    sums = json.loads((tmp_path / "global_step2" / manifest.MANIFEST).read_text())["checksums"]
    assert {"state/rank_00000.safetensors", "state/rank_00000.json"} <= sums.keys()
    # Hashed from disk: the client state, the meta and the config, once each; no state file.
    assert not any(name.startswith("state/rank_") for name in read_back), read_back
    assert "state/client_state.pt" in read_back and set(read_back.values()) == {1}
