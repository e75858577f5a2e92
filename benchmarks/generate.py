"""Generation speed on the user's path: `python deepy.py generate.py` against transformers.

For each model shape, random weights are saved as a neox checkpoint; generate.py runs on it in
input-file mode through deepy.py (one launch per batch size), and its own per-batch speed
(`tokens_per_second` in the rows it writes) is read back: the first batch is a warm-up (CUDA
graph capture, and on a GPU the compilation of the decode step), the median of the others is
reported (generate.py's defaults: on a GPU the fused step at batches of 1, 2 or 4, else the eager
step, captured as a CUDA graph). On a GPU it runs a second time with `torch_compile: true` and
`fused_decode: false` (the whole step compiled, then captured, at every batch;
--no-neox-compiled-step skips it). transformers' `generate` decodes the same
prompts with the same weights (exported through hf_map), with its default dynamic cache and with
its static cache, which its `generate` compiles (torch.compile, mode reduce-overhead: CUDA
graphs) on a GPU, as its docs describe. The weight-bandwidth roofline is the batch times the
device's copy bandwidth (a large device-to-device copy, measured here) over the bytes of weights
a decode step reads (KV cache reads are not counted).

The tokenizer is the character-level one (prompts of N ASCII characters are N tokens) while the
embedding keeps the Pythia shape's 50304 rows; the output rows of the end-of-document id and of
the ids past the tokenizer are zero, so their logit (0) never wins greedily against hundreds of
random ones: every row runs its whole budget on both sides, and both pick among the same ids.

    python benchmarks/generate.py --models 410M --batch-sizes 1          # one GPU
    python benchmarks/generate.py --models 1-4B --batch-sizes 16 --no-hf-compile
    python benchmarks/generate.py --tiny --device cpu --new-tokens 8       # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from benchmarks import common  # noqa: E402
from neox.checkpoint.writer import write_checkpoint  # noqa: E402
from neox.config import load_config  # noqa: E402
from neox.hf.mapping import hf_config_for, to_hf_state_dict  # noqa: E402
from neox.model import build_model  # noqa: E402
from neox.tokenizer.char import CHAR_EOD, CHAR_VOCAB_SIZE  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PYTHIA_PADDED_VOCAB = 50304
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, attention_config=[[["global"], 2]])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["410M"], help="configs/pythia/<name>.yml")
    p.add_argument("--tiny", action="store_true", help=f"shrink each model to {TINY}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="fp32 on CPU whatever this says")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed batches (median) after a warm-up")
    p.add_argument(
        "--hf-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time transformers with its static cache + torch.compile (default: on GPU)",
    )
    p.add_argument(
        "--neox-compiled-step",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run generate.py with torch_compile: true, the whole decode step compiled "
        "before capture (default: on GPU)",
    )
    p.add_argument("--workdir", help="where checkpoints and rows go (default: a temporary dir)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least 1 timed batch")
    if args.device == "cpu":
        args.dtype = "fp32"  # generate.py computes in fp32 on CPU
    if args.hf_compile is None:
        args.hf_compile = args.device == "cuda"
    if args.neox_compiled_step is None:
        args.neox_compiled_step = args.device == "cuda"
    return args


def run_config(args: argparse.Namespace, model: str, workdir: Path) -> tuple[Path, Path]:
    """(the Pythia config, an override file: char tokenizer, Pythia's padded vocabulary, the
    benchmark's precision, checkpoint location and generation keys; batch keys come later)."""
    base = ROOT / "configs" / "pythia" / f"{model}.yml"
    if not base.exists():
        raise SystemExit(f"--models {model}: no {base.relative_to(ROOT)}")
    keys = {
        "tokenizer_type": "CharLevelTokenizer",
        "vocab_file": None,
        "padded_vocab_size": CHAR_VOCAB_SIZE if args.tiny else PYTHIA_PADDED_VOCAB,
        "fp16": {"enabled": args.dtype == "fp16"},
        "bf16": {"enabled": args.dtype == "bf16"},
        "load": str(workdir / "ckpt"),
        "save": None,
        "num_gpus": 1,
        "text_gen_type": "input-file",
        "maximum_tokens": args.new_tokens,
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 0.0,
        **(TINY if args.tiny else {}),
    }
    override = workdir / "bench.yml"
    override.write_text(yaml.safe_dump(keys))
    return base, override


def save_checkpoint(base: Path, override: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights of the shape, end-of-document and padded output rows zeroed, saved at
    `load`; returns the model (CPU)."""
    cfg = load_config([str(base), str(override)]).config
    padded = cfg.tokenizer.padded_vocab_size
    model = build_model(cfg.model, padded, seed=1234)
    with torch.no_grad():
        head = model.head_weight()
        head[CHAR_EOD] = 0
        head[CHAR_VOCAB_SIZE:] = 0
    model = model.to(dtype).eval()
    write_checkpoint(model.state_dict(), cfg, Path(cfg.checkpoint.load), 0)
    return model


def prompts_for(args: argparse.Namespace, batch: int) -> list[str]:
    """(1 + repeats) batches of random printable prompts, prompt-tokens characters each."""
    rng = random.Random(batch)
    alphabet = string.ascii_letters + string.digits + " .,"
    n = (1 + args.repeats) * batch
    return ["".join(rng.choices(alphabet, k=args.prompt_tokens)) for _ in range(n)]


def run_neox(
    args: argparse.Namespace,
    configs: list[Path],
    workdir: Path,
    batch: int,
    prompts: list[str],
    compiled_step: bool = False,
) -> tuple[list[dict], float]:
    """generate.py through deepy.py on the prompts: (its rows, seconds the launch took).
    compiled_step: with `torch_compile: true` and `fused_decode: false`, the compiled step at
    every batch (else generate.py's defaults: the fused step at batches of 1, 2 or 4)."""
    (workdir / f"prompts{batch}.txt").write_text("\n".join(prompts) + "\n")
    name = f"{batch}{'_compiled' if compiled_step else ''}"
    keys = {
        "train_micro_batch_size_per_gpu": batch,
        "sample_input_file": str(workdir / f"prompts{batch}.txt"),
        "sample_output_file": str(workdir / f"rows{name}.jsonl"),
        **({"torch_compile": True, "fused_decode": False} if compiled_step else {}),
    }
    batch_cfg = workdir / f"batch{name}.yml"
    batch_cfg.write_text(yaml.safe_dump(keys))
    env = common.child_env()
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    cmd = [
        sys.executable,
        str(ROOT / "deepy.py"),
        "generate.py",
        *map(str, configs),
        str(batch_cfg),
    ]
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    seconds = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in Path(keys["sample_output_file"]).read_text().splitlines()]
    return rows, seconds


def batch_speed(rows: list[dict], batch: int) -> tuple[float, float]:
    """(median tokens/s, median prefill seconds) of generate.py's batches after the first."""
    firsts = rows[batch::batch]  # each batch's rows share its speed fields
    return (
        statistics.median(r["tokens_per_second"] for r in firsts),
        statistics.median(r["prefill_seconds"] for r in firsts),
    )


def hf_model(model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
    """transformers' GPTNeoXForCausalLM holding `model`'s weights (all padded rows too)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg, rows = model.cfg, model.vocab_size
    hf_cfg = GPTNeoXConfig(**hf_config_for(cfg, rows, "gpt_neox"))
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        hf = GPTNeoXForCausalLM(hf_cfg)
    sd = to_hf_state_dict(model.state_dict(), cfg, rows, "gpt_neox")
    # transformers >= 5 calls the output layer lm_head in memory (embed_out in files).
    sd = {("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in sd.items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if not cfg.no_weight_tying:
        hf.tie_weights()
    return hf.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def hf_greedy(hf, ids: torch.Tensor, n: int, static: bool) -> list[list[int]]:
    """Exactly n greedy tokens per row from transformers' generate."""
    extra = {"cache_implementation": "static"} if static else {}
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=CHAR_EOD,
        **extra,
    )
    return out[:, ids.shape[1] :].tolist()


def timed(fn: Callable[[], list[list[int]]], device: torch.device, repeats: int, warmups: int):
    """(median seconds, tokens of the last run) after warm-up runs."""
    for _ in range(warmups):
        fn()
    seconds = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (each byte read once and written once)."""
    n = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps = 10
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - start)


def step_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Weight bytes one decode step reads: every parameter but an untied input embedding (a
    gather of B rows)."""
    skip = {model.embed_in.weight} if model.embed_out is not None else set()
    size = torch.tensor([], dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters() if p not in skip) * size


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    n = args.new_tokens
    import transformers

    print(
        f"# generation through `deepy.py generate.py` (input-file) against transformers "
        f"{transformers.__version__}, device {name}, torch {torch.__version__}, {args.dtype}, "
        f"prompt {args.prompt_tokens} tokens, {n} new tokens, greedy, median of {args.repeats} "
        f"batches after a warm-up; copy bandwidth {bandwidth / 1e9:,.0f} GB/s, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
    )
    cols = "| model | batch | neox tok/s | % of roofline | prefill ms |"
    if args.neox_compiled_step:
        cols += " neox compiled step tok/s | % of roofline | compiled-step rows = neox rows |"
    cols += " launch s | transformers tok/s | neox / transformers |"
    if args.hf_compile:
        cols += " transformers static+compile tok/s | % of roofline | neox / static+compile |"
    cols += " same tokens |"
    print(cols)
    print("| --- |" + " ---: |" * (cols.count("|") - 2))
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models:
            workdir = Path(args.workdir or tmp) / model_name
            workdir.mkdir(parents=True, exist_ok=True)
            for cells in bench_model(args, model_name, workdir, bandwidth):
                print("| " + " | ".join(cells) + " |", flush=True)
    return 0


def bench_model(args: argparse.Namespace, model_name: str, workdir: Path, bandwidth: float):
    """The table's rows for one model shape, a batch size each."""
    device, dtype, n = torch.device(args.device), DTYPES[args.dtype], args.new_tokens
    base, override = run_config(args, model_name, workdir)
    model = save_checkpoint(base, override, dtype)
    roofline = bandwidth / step_bytes(model, dtype)  # decode steps per second
    label = f"{model_name}{' (tiny)' if args.tiny else ''}"

    def pct(rate: float, batch: int) -> str:
        return f"{100 * rate / (batch * roofline):.0f}%"

    # generate.py first, while this process holds no device memory.
    launches = []
    for batch in args.batch_sizes:
        prompts = prompts_for(args, batch)
        rows, seconds = run_neox(args, [base, override], workdir, batch, prompts)
        compiled = None
        if args.neox_compiled_step:
            compiled = run_neox(
                args, [base, override], workdir, batch, prompts, compiled_step=True
            )[0]
        launches.append((batch, prompts, rows, seconds, compiled))
    hf = hf_model(model, device, dtype)
    del model
    for batch, prompts, rows, seconds, compiled in launches:
        rate, prefill = batch_speed(rows, batch)
        ids = torch.tensor([list(p.encode()) for p in prompts[:batch]], device=device)
        t_hf, tok_hf = timed(lambda: hf_greedy(hf, ids, n, False), device, args.repeats, 1)  # noqa: B023
        ours = [r["tokens"] for r in rows[:batch]]
        same = sum(a == b for x, y in zip(ours, tok_hf) for a, b in zip(x, y))
        cells = [label, str(batch), f"{rate:,.0f}", pct(rate, batch), f"{prefill * 1e3:,.1f}"]
        if compiled is not None:
            c_rate, _ = batch_speed(compiled, batch)
            c_same = sum(a["tokens"] == b["tokens"] for a, b in zip(compiled, rows)) / len(rows)
            cells += [f"{c_rate:,.0f}", pct(c_rate, batch), f"{c_same:.0%}"]
        cells += [f"{seconds:.0f}", f"{batch * n / t_hf:,.0f}", f"{rate * t_hf / (batch * n):.2f}x"]
        if args.hf_compile:
            hf_rate = hf_compiled_rate(hf, ids, n, device, args.repeats)
            if hf_rate is None:
                cells += ["failed", "-", "-"]
            else:
                cells += [f"{hf_rate:,.0f}", pct(hf_rate, batch), f"{rate / hf_rate:.2f}x"]
        cells.append(f"{same / (batch * n):.0%}")
        yield cells


def hf_compiled_rate(hf, ids, n, device, repeats) -> float | None:
    """New tokens/s of transformers' documented fast path, or None if it fails: the static
    cache, with which its `generate` compiles the forward itself (torch.compile, mode
    reduce-overhead: CUDA graphs, per its CompileConfig defaults). Compiling the forward by
    hand on top of that (as this benchmark once did) replays two layers of CUDA graphs and
    fails with "accessing tensor output of CUDAGraphs that has been overwritten"."""
    try:
        # Two warm-ups: the first traces and compiles, the second records the CUDA graphs.
        t, _ = timed(lambda: hf_greedy(hf, ids, n, True), device, repeats, 2)
    except Exception as e:  # noqa: BLE001 (a failing comparison is reported, not fatal)
        print(f"transformers static+compile failed: {type(e).__name__}: {e}"[:300], flush=True)
        return None
    if getattr(hf, "_compiled_call", None) is None:
        print("transformers static cache: generate did not compile its forward", flush=True)
    return ids.shape[0] * n / t


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
