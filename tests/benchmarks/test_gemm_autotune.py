"""benchmarks/gemm_autotune.py --tiny on CPU: a record per block linear, so the GPU script
cannot rot."""

import json

from tests.benchmarks.bench_helpers import run_benchmark


def test_tiny_run_times_both_paths_of_each_linear():
    r = run_benchmark("gemm_autotune.py", "--tiny", "--only", "dense", "output_layer")
    records = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [x["linear"] for x in records] == ["dense", "output_layer"]
    assert records[1]["out"] == 128 and records[1]["in"] == 64
    for x in records:
        assert x["cublas_ms"] > 0 and x["max_autotune_ms"] > 0
        assert x["autotune_over_cublas"] == x["cublas_ms"] / x["max_autotune_ms"]
