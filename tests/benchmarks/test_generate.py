"""benchmarks/generate.py runs on CPU at the tiny shape, through deepy.py generate.py, so it
cannot rot."""

import subprocess
import sys

from tests.train_helpers import ROOT, deepy_env


def run_tiny(script: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/<script> at the tiny shape on CPU, writing under tmp_path; asserts success."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--tiny", "--device=cpu"]
        + [*args, "--prompt-tokens=8", "--repeats=1", f"--workdir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=deepy_env(cpu=True),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_tiny_cpu_run_prints_generate_py_speed_and_matching_tokens(tmp_path):
    r = run_tiny("generate.py", tmp_path, "--batch-sizes", "1", "3", "--new-tokens=6")
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| model"))
    names = [c.strip() for c in header.strip("|").split("|")]
    rows = [
        dict(zip(names, (c.strip() for c in line.strip("|").split("|"))))
        for line in lines
        if line.startswith("| 410M")
    ]
    assert [row["batch"] for row in rows] == ["1", "3"]
    for row in rows:
        # The speed generate.py itself wrote into its rows, read back.
        assert float(row["neox tok/s"].replace(",", "")) > 0
        assert float(row["prefill ms"].replace(",", "")) > 0
        assert row["% of roofline"].endswith("%")
        # fp32 greedy: both engines pick the same tokens.
        assert row["same tokens"] == "100%", r.stdout
    # The generated prompts and rows are generate.py's own input and output.
    assert (tmp_path / "410M" / "rows3.jsonl").read_text().count("\n") == 2 * 3


def test_first_token_benchmark_reports_each_cache_state_and_the_decode_path(tmp_path):
    r = run_tiny("generate_first_token.py", tmp_path, "--batch-sizes=2", "--new-tokens=4")
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| 410M")]
    assert [c[2].strip() for c in rows] == ["cold", "warm"]  # nothing tuned on CPU: no "untuned"
    for cells in rows:
        assert cells[4].strip() == "the eager step with a KV cache on cpu"
        # generate.py's own first-token line was found and read: a time after its start.
        assert 0 < float(cells[5]) < float(cells[8])
