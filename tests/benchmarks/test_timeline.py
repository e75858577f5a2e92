"""benchmarks/timeline.py: a profiled rank's device time split into compute, communication no
compute hid, and idle, on a hand-made trace whose answer is known."""

import json

from benchmarks.timeline import rank_timelines, timeline, timeline_lines, trace_timeline


def kernel(name, start_ms, end_ms, cat="kernel"):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": start_ms * 1e3,
        "dur": (end_ms - start_ms) * 1e3,
    }


EVENTS = [
    kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 10),
    kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 5, 15),
    kernel("triton_poi_fused_add_0", 20, 30),
    kernel("Memcpy DtoD (Device -> Device)", 30, 35, cat="gpu_memcpy"),
    kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 40, 50),
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 60e3},  # host: not counted
]


def test_busy_compute_exposed_communication_and_idle():
    t = timeline(EVENTS, steps=1)
    assert t == {
        "span_ms": 50.0,
        "busy_ms": 40.0,  # [0, 15] + [20, 35] + [40, 50]
        "compute_ms": 25.0,  # [0, 10] + [20, 35]
        "comm_ms": 20.0,
        "exposed_comm_ms": 15.0,  # the all-reduce's [10, 15] and the whole send/recv
        "idle_ms": 10.0,
        "nccl_AllReduce_ms": 10.0,
        "nccl_SendRecv_ms": 10.0,
    }
    assert timeline(EVENTS, steps=2)["busy_ms"] == 20.0  # per step


def test_a_trace_without_device_activity_gives_none(tmp_path):
    trace = tmp_path / "rank0_iters5-6.trace.json"
    trace.write_text(json.dumps({"traceEvents": EVENTS[-1:]}))
    assert trace_timeline(trace) is None
    trace.write_text(json.dumps({"traceEvents": EVENTS}))
    assert trace_timeline(trace, steps=1)["idle_ms"] == 10.0


def test_a_runs_ranks_are_read_and_printed_in_order(tmp_path):
    """A run's profile/ folder: each rank's timeline (none for a rank without device activity),
    one printed line each."""
    (tmp_path / "rank1_iters5-6.trace.json").write_text(json.dumps({"traceEvents": EVENTS}))
    (tmp_path / "rank0_iters5-6.trace.json").write_text(json.dumps({"traceEvents": EVENTS}))
    (tmp_path / "rank2_iters5-6.trace.json").write_text(json.dumps({"traceEvents": EVENTS[-1:]}))
    ranks = rank_timelines(tmp_path)
    assert list(ranks) == ["rank0", "rank1"] and ranks["rank1"]["busy_ms"] == 20.0
    lines = timeline_lines("6-9B tp2_pp2", ranks)
    assert lines[0].startswith("6-9B tp2_pp2 rank0 ms a profiled step: span 25.0, busy 20.0")
