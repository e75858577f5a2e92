"""neox.kernels.adamw: the interpreter cases in a fresh process (TRITON_INTERPRET=1 must precede
the triton import)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("adamw_interpreter_cases.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_adamw_kernel_under_interpreter():
    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, f"interpreter cases failed:\n{report}"
    assert " passed" in result.stdout and "skipped" not in result.stdout, report
