"""The decode kernels and the fused decode step, under Triton's interpreter in a fresh process
(tests/kernels/decode_interpreter_helpers.py)."""

from pathlib import Path

from tests.kernels.interpreter_helpers import run_interpreter_cases


def test_decode_kernels_under_the_interpreter():
    run_interpreter_cases(Path(__file__).with_name("decode_interpreter_helpers.py"))
