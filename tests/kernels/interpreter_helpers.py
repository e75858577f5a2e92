"""Triton's interpreter runs on CPU only when TRITON_INTERPRET=1 is set before triton is
imported: the interpreter case files run in a fresh pytest process with it set."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_interpreter_cases(cases: Path) -> None:
    """Run the pytest file `cases` under the interpreter; fail with its report if any case
    fails or is skipped."""
    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pytest", str(cases), "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, f"interpreter cases failed:\n{report}"
    assert " passed" in result.stdout and "skipped" not in result.stdout, report
