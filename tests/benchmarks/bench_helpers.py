"""Running a benchmark script the way a user does: `python benchmarks/<name>.py ...` from the
checkout, this checkout first on the path."""

import subprocess
import sys
from pathlib import Path

from tests.process_helpers import child_env

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(
    script: str, *args: str, timeout: float = 300, check: bool = True, **env: str
) -> subprocess.CompletedProcess:
    """benchmarks/<script> with args and extra environment; asserts exit 0 unless check=False."""
    r = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *map(str, args)],
        cwd=ROOT,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r
