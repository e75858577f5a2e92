"""neox.kernels.adamw: its interpreter cases in a fresh process."""

from pathlib import Path

from tests.kernels.interpreter_helpers import run_interpreter_cases


def test_adamw_kernel_under_interpreter():
    run_interpreter_cases(Path(__file__).with_name("adamw_interpreter_helpers.py"))
