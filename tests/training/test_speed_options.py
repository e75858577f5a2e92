"""Speed options on 2 CPU ranks reproduce the reference loss curve.

One reference run, then every option at once on data parallelism (chunked output-layer loss,
compiled blocks under activation checkpointing, the profiler), and compiled blocks under tensor
and under pipeline parallelism. Compilation uses the aot_eager backend: the same traced graphs
as inductor, without generating CPU kernels (inductor takes minutes per graph on 2 CPU cores).
"""

import json

import numpy as np
import pytest

from tests.train_helpers import SHORT_RUN, losses, make_dataset, run_here, train, write_config

pytestmark = pytest.mark.slow

COMPILE = dict(torch_compile=True, torch_compile_backend="aot_eager")
# Two data-parallel ranks, one micro-batch of 2 each: the 4 samples per step that a tp=2 run
# (one data-parallel rank) sees as 2 micro-batches of 2.
DP2 = dict(SHORT_RUN, gradient_accumulation_steps=1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("speed")
    make_dataset(tmp / "data" / "chars")
    train(write_config(tmp, "ref", **DP2))
    return tmp, losses(tmp / "ref" / "logs")


def test_chunked_loss_compile_checkpointing_and_profile(reference):
    tmp, ref = reference
    cfg = write_config(
        tmp,
        "fast",
        **DP2,
        **COMPILE,
        lm_loss_chunk_size=8,
        checkpoint_activations=True,
        profile=True,
        profile_step_start=2,
        profile_step_stop=3,
        peak_theoretical_tflops=1.0,
    )
    r = train(cfg)
    got = losses(tmp / "fast" / "logs")
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    records = [
        json.loads(x) for x in (tmp / "fast" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    train_records = [x for x in records if x["split"] == "train"]
    assert all(x["tflops_per_gpu"] > 0 and 0 < x["mfu"] < 1 for x in train_records)
    assert "tflops_per_gpu" in r.stderr + r.stdout and "mfu" in r.stderr + r.stdout
    profile = tmp / "fast" / "logs" / "profile"
    for rank in (0, 1):
        assert (profile / f"rank{rank}_iters2-3.trace.json").stat().st_size > 0
        assert "aten::" in (profile / f"rank{rank}_iters2-3.ops.txt").read_text()
    assert "host syncs per iteration" in r.stderr + r.stdout


@pytest.mark.parametrize("layout", ["model_parallel_size", "pipe_parallel_size"])
def test_compiled_blocks_under_tensor_and_pipeline_parallelism(reference, layout):
    tmp, ref = reference
    r = run_here(
        "train.py",
        write_config(tmp, layout, **SHORT_RUN, **COMPILE, **{layout: 2}),
        check=False,
        TORCH_LOGS="graph_breaks",
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    # Each block is one graph: without attention dropout, tensor parallelism forks no RNG.
    assert "Graph break" not in r.stderr + r.stdout
    got = losses(tmp / layout / "logs")
    assert all(np.isfinite(v) for v in got.values())
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
