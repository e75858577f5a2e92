"""Where a decode step's time goes: device time of one captured step, its kernels, the roofline.

For a Pythia shape with random weights (bf16), the engine's captured greedy step
(neox/inference/generator.py) is replayed from a fresh cache position and timed with CUDA events;
torch.profiler counts the kernels of a few replays and lists the costliest. Variants (VARIANTS):
the eager step captured as is (`generate.py`'s default), the step compiled by inductor before
capture (`generate.py` with `torch_compile: true`), that step with its one-row products as
generated reductions (neox/inference/decode_compile.py), optionally with inductor options, and
the fused step (neox/inference/fused_step.py: three Triton kernels a layer, no compilation).

    python benchmarks/decode_step.py --models 410M --batch-sizes 1 16
    python benchmarks/decode_step.py --models 410M --batch-sizes 1 --variants compiled compiled_reductions
    python benchmarks/decode_step.py --models 410M 1-4B --batch-sizes 1 --variants fused fused_no_pdl fused_torch_choice
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from neox.config import load_config  # noqa: E402
from neox.inference.decode_compile import StepKernels  # noqa: E402
from neox.inference.generator import Generator  # noqa: E402
from neox.kernels import decode as decode_kernels  # noqa: E402
from neox.model import build_model  # noqa: E402

# Decode-step variants: the eager step captured ("graph"), or compiled with these kernels.
VARIANTS = {
    "graph": StepKernels(),
    "compiled": StepKernels(),  # generate.py's with torch_compile: cuBLAS and SDPA kernels
    "compiled_no_combo": StepKernels(combo_kernels=False),  # each small kernel launched alone
    "compiled_gemv": StepKernels(gemv_reductions=True),  # batch-1 linears as reductions
    "compiled_attention": StepKernels(attention_reductions=True),  # batch-1 attention only
    "compiled_reductions": StepKernels(gemv_reductions=True, attention_reductions=True),
    "fused": StepKernels(),  # neox/inference/fused_step.py: three Triton kernels a layer
    "fused_no_pdl": StepKernels(),  # the same, each kernel launched after the last one ends
    "fused_torch_choice": StepKernels(),  # the fused step, torch's argmax and bookkeeping
}
UNCOMPILED = {"graph", "fused", "fused_no_pdl", "fused_torch_choice"}
PADDED = 50304
VOCAB = 50277


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["410M"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["graph", "compiled"])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--mode", default=None, help="torch.compile mode for the compiled variant")
    p.add_argument(
        "--inductor", nargs="*", default=[], help="torch._inductor.config options, key=value"
    )
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", help="append one JSON line per measurement here")
    return p.parse_args(argv)


def copy_bandwidth() -> float:
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * n * 10 / (time.perf_counter() - start)


def step_bytes(model: torch.nn.Module) -> int:
    skip = {model.embed_in.weight} if model.embed_out is not None else set()
    return sum(p.numel() * p.element_size() for p in model.parameters() if p not in skip)


def replay_ms(gen: Generator, batch: int, prompt: int, replays: int) -> list[float]:
    """Device ms per replay of the session's captured step, from slot `prompt` on."""
    session = gen._session
    state, step = session.state, session.step
    mask = torch.ones((batch, prompt), dtype=torch.bool, device="cuda")
    times = []
    for _ in range(3):
        state.start(mask)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            step()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / replays)
    return times


def kernels(gen: Generator, batch: int, prompt: int, n: int = 5) -> tuple[float, list[str]]:
    """(kernels per step, the top lines of the profile) over n replays."""
    from torch.profiler import ProfilerActivity, profile

    session = gen._session
    session.state.start(torch.ones((batch, prompt), dtype=torch.bool, device="cuda"))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            session.step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages().table(
        sort_by="device_time_total", row_limit=18, max_name_column_width=70
    )
    return len(events) / n, table.splitlines()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    common.set_inductor_options(args.inductor)
    bandwidth = copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(
        f"# decode step, {name}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e9:,.0f} GB/s"
    )
    print(f"# inductor options {args.inductor}, mode {args.mode}")
    for model_name in args.models:
        cfg = load_config([str(ROOT / "configs" / "pythia" / f"{model_name}.yml")]).config.model
        model = build_model(cfg, PADDED, seed=1234).to("cuda", torch.bfloat16).eval()
        roofline_ms = step_bytes(model) / bandwidth * 1e3
        prompts_g = torch.Generator().manual_seed(0)
        for batch in args.batch_sizes:
            prompts = torch.randint(0, VOCAB, (batch, args.prompt_tokens), generator=prompts_g)
            prompts = prompts.tolist()
            for variant in args.variants:
                torch._dynamo.reset()
                gen = Generator(
                    model,
                    VOCAB,
                    eod=PADDED - 1,
                    compile_step=variant not in UNCOMPILED,
                    step_kernels=VARIANTS[variant],
                    fused_step=variant.startswith("fused"),
                )
                decode_kernels.PDL = variant != "fused_no_pdl"
                if gen._fused is not None:
                    gen._fused.greedy_kernel = variant != "fused_torch_choice"
                if variant not in UNCOMPILED and args.mode:
                    gen._compiled = torch.compile(gen._decode, dynamic=False, mode=args.mode)
                t0 = time.perf_counter()
                gen.generate(prompts, args.new_tokens)
                first = time.perf_counter() - t0
                calls, prefills = [], []
                for _ in range(3):  # the engine's generate, warm: median of three calls
                    t0 = time.perf_counter()
                    gen.generate(prompts, args.new_tokens)
                    calls.append(time.perf_counter() - t0)
                    prefills.append(gen.last_stats.prefill_seconds)
                e2e = batch * args.new_tokens / statistics.median(calls)
                ms = statistics.median(replay_ms(gen, batch, args.prompt_tokens, args.replays))
                row = dict(
                    model=model_name,
                    batch=batch,
                    variant=variant,
                    compiled=gen._compiled is not None,
                    fused=gen.fused_for(batch),
                    step_ms=round(ms, 4),
                    roofline_ms=round(roofline_ms, 4),
                    pct_roofline=round(100 * roofline_ms / ms, 1),
                    tok_s_step=round(batch * 1e3 / ms),
                    tok_s_generate=round(e2e),
                    prefill_ms=round(1e3 * statistics.median(prefills), 1),
                    first_call_s=round(first, 1),
                )
                if args.profile:
                    per_step, table = kernels(gen, batch, args.prompt_tokens)
                    row["kernels_per_step"] = per_step
                    print("\n".join(table))
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
                del gen
                torch.cuda.empty_cache()
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
