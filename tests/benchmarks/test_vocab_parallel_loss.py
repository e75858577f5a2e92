"""benchmarks/vocab_parallel_loss.py at tiny shapes on CPU (fp32; aot_eager, which needs no C++
compiler): the before-version, the plain ops eager and compiled, each row's differences from the
before-version within fp32 rounding, so the script the GPU run depends on cannot rot."""

from tests.benchmarks.bench_helpers import run_benchmark


def test_tiny_run_prints_three_variants_that_agree():
    tiny = ["--tokens", 64, "--hidden", 32, "--vocab-shard", 96, "--iters", 2, "--warmup", 1]
    r = run_benchmark("vocab_parallel_loss.py", *tiny, "--dtype", "fp32", "--backend", "aot_eager")
    rows = [line.split(" | ") for line in r.stdout.splitlines() if line.startswith("| (")]
    assert [row[0][2:5] for row in rows] == ["(a)", "(b)", "(c)"]
    for row in rows:
        assert float(row[1]) > 0 and row[2] == "-"  # peak memory: CUDA runs only
        assert all(float(d.strip(" |")) < 1e-5 for d in row[3:]), row
