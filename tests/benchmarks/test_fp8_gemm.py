"""benchmarks/fp8_gemm.py --tiny on CPU: every matmul of a block and the output layer, in bf16
and float8 (torch._scaled_mm), timed and summed, so the script cannot rot."""

import json

from tests.benchmarks.bench_helpers import run_benchmark


def test_tiny_run_times_each_matmul_of_a_block(tmp_path):
    out = tmp_path / "gemm.jsonl"
    r = run_benchmark("fp8_gemm.py", "--tiny", "--json", out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    rows, summary = records[:-1], records[-1]
    assert len(rows) == 15  # 5 linears x (output, grad_input, grad_weight)
    assert {r["matmul"] for r in rows} >= {"qkv out", "4h_to_h grad_w", "head grad_in"}
    qkv = next(r for r in rows if r["matmul"] == "qkv grad_w")
    assert (qkv["m"], qkv["k"], qkv["n"]) == (192, 128, 64)  # g^T (N, M) x (M, K)
    assert all(r["bf16_ms"] > 0 and r["fp8_ms"] > 0 and r["cast_ms"] > 0 for r in rows)
    assert summary["block_bf16_ms"] > 0 and summary["block_fp8_default_ms"] > 0
    assert "one block's matmuls: bf16" in r.stdout
