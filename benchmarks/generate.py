"""Generation speed: neox's engine (static KV cache) against transformers' `generate`.

Both hold the same random weights (ours exported in memory through hf_map), decode greedily
from the same random prompts for exactly --new-tokens tokens, and are timed end to end
(prefill included). Prints a markdown table of generated tokens per second.

    python benchmarks/generate.py --device cuda --dtype bf16 --batch-sizes 1 16
    python benchmarks/generate.py --tiny --device cpu --new-tokens 8   # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from neox.checkpoint.hf_map import hf_config_for, to_hf_state_dict  # noqa: E402
from neox.config import load_config  # noqa: E402
from neox.config.derived import padded_vocab  # noqa: E402
from neox.inference.engine import Generator  # noqa: E402
from neox.model import build_model  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PYTHIA_VOCAB = 50277  # the Pythia tokenizer's size; the model pads it to 50304 rows
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, attention_config=[[["global"], 2]])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/pythia/410M.yml"), help="model shape")
    p.add_argument("--tiny", action="store_true", help=f"shrink the model to {TINY}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs (median) after one warmup")
    return p.parse_args(argv)


def build_pair(args: argparse.Namespace):
    """(our model, transformers' GPTNeoXForCausalLM with the same weights, vocab size)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    run_cfg = load_config([args.config]).config
    cfg = run_cfg.model
    if args.tiny:
        cfg = cfg.model_copy(update=TINY)
    vocab = 512 if args.tiny else PYTHIA_VOCAB
    padded = padded_vocab(run_cfg, vocab)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    model = build_model(cfg, padded, seed=1234).to(device=device, dtype=dtype).eval()
    hf_cfg = GPTNeoXConfig(**hf_config_for(cfg, vocab, "gpt_neox"))
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        hf = GPTNeoXForCausalLM(hf_cfg)
    sd = to_hf_state_dict(model.state_dict(), cfg, vocab, "gpt_neox")
    # transformers >= 5 calls the output layer lm_head in memory (embed_out in files).
    sd = {("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in sd.items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if not cfg.no_weight_tying:
        hf.tie_weights()
    return model, hf.to(device=device, dtype=dtype).eval(), vocab


@torch.no_grad()
def hf_greedy(hf, ids: torch.Tensor, n: int) -> list[list[int]]:
    """Exactly n greedy tokens per row from transformers' generate (its default dynamic cache)."""
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, ids.shape[1] :].tolist()


def timed(fn: Callable[[], list[list[int]]], device: torch.device, repeats: int):
    """(median seconds, tokens of the last run) after one warmup run."""
    fn()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    model, hf, vocab = build_pair(args)
    device = torch.device(args.device)
    # The end-of-document id is a padded row, which is never sampled: every run is full length.
    eod = model.vocab_size - 1
    engine = Generator(model, vocab, eod)
    n = args.new_tokens
    print(
        f"# generation, {'tiny' if args.tiny else Path(args.config).name} shape, {args.dtype} on "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, prompt "
        f"{args.prompt_tokens} tokens, {n} new tokens, greedy, median of {args.repeats}\n"
    )
    print("| batch | neox tok/s | transformers tok/s | neox / transformers | same tokens |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batch_sizes:
        rng = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, vocab, (batch, args.prompt_tokens), generator=rng)
        prompts = ids.tolist()
        ids = ids.to(device)

        def ours(prompts=prompts):
            return [c.tokens for c in engine.generate(prompts, n)]

        t_ours, tok_ours = timed(ours, device, args.repeats)
        t_hf, tok_hf = timed(lambda ids=ids: hf_greedy(hf, ids, n), device, args.repeats)
        same = sum(a == b for x, y in zip(tok_ours, tok_hf) for a, b in zip(x, y))
        rate_ours, rate_hf = batch * n / t_ours, batch * n / t_hf
        print(
            f"| {batch} | {rate_ours:,.0f} | {rate_hf:,.0f} | {rate_ours / rate_hf:.2f}x | "
            f"{same / (batch * n):.0%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
