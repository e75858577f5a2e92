"""benchmarks/sdpa_backends.py --tiny on CPU: a record per shape and backend, so the GPU script
cannot rot."""

import json

from tests.benchmarks.bench_helpers import run_benchmark


def test_tiny_run_times_default_and_math_at_every_shape():
    r = run_benchmark("sdpa_backends.py", "--tiny")
    records = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert {(x["shape"], x["backend"]) for x in records} == {
        (shape, backend) for shape in ("160M", "410M", "1-4B") for backend in ("default", "math")
    }
    assert all(x["ms"] > 0 and x["tflops"] > 0 for x in records)


def test_context_parallel_rows_take_a_ranks_share_of_the_heads():
    r = run_benchmark(
        "sdpa_backends.py", "--tiny", "--shapes", "1-4B", "--context-parallel", "0", "2", "4"
    )
    records = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    heads = {x.get("context_parallel", 0): x["heads"] for x in records}
    assert heads == {0: 4, 2: 2, 4: 1}
    assert all(x["ms"] > 0 and x["tflops"] > 0 for x in records)
