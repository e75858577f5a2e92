#!/usr/bin/env python
"""The MFU neox logs beside Megatron-LM's and torchtitan's formulas, for the same run.

python benchmarks/mfu_formulas.py     # the table in docs/benchmarks.md ("One MFU formula")

Each formula gives training FLOPs per token; MFU = tokens/s x FLOPs per token / (GPUs x peak).
- neox (neox/plan/estimate.py `train_flops_per_token`, what metrics.jsonl's `mfu` uses):
  6 N + 12 L h s. N: every matrix a token passes through, counted from the real tensor shapes
  (GQA, gated MLPs, biases, norms; the output layer whether or not tied; not the input
  embedding). 12 L h s: attention scores and their weighted sum over all s keys (not halved for
  the causal mask), h = heads x head_dim. Activation recomputation is not counted.
- Megatron-LM (Narayanan et al. 2021, eq. 3): 72 L h^2 (1 + s / 6h + V / 12 L h) per token
  without recomputation; with full recomputation the layers' forward runs twice: 96 L h^2
  (1 + s / 6h) + 6 h V. It assumes multi-head attention and a 4h MLP, and ignores biases and
  norms.
- torchtitan (`get_num_flop_per_token`): 6 N' + 12 L h s, N' = all parameters minus the
  embedding tables (so a tied output layer is not counted); no recomputation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neox.config import load_config  # noqa: E402
from neox.config.derived import padded_vocab  # noqa: E402
from neox.config.model import ModelConfig  # noqa: E402
from neox.plan.estimate import count_parameters, train_flops_per_token  # noqa: E402

PEAK_TFLOPS = 989.0  # H100 SXM / H200 dense bf16, as neox/training/metrics.py reads it

# (config, seq, TP, PP, GPUs, tokens/s, activation checkpointing, source of the tokens/s)
RUNS = [
    ("configs/pythia/6-9B.yml", 2048, 2, 2, 4, 42_600, False, "issue 34, 4 x H200"),
    ("configs/pythia/6-9B.yml", 2048, 2, 1, 4, 35_400, True, "issue 34, 4 x H200"),
    ("configs/20B.yml", 2048, 2, 2, 4, 36_600, False, "issue 34, 12 layers, 4 x H200"),
]
# Shapes where the formulas part: GQA + gated MLP (Llama 3), a tied output layer (Qwen3 0.6B).
SHAPES = ["configs/pythia/1-4B.yml", "configs/llama3/8B.yml", "configs/qwen3/0-6B.yml"]
# 20B at 12 layers, as the run cut it.
LAYERS = {("configs/20B.yml", 36_600): 12}
GPT_NEOX_20B_VOCAB = 50_277  # the tokenizer's size; padded per config below


def model_of(name: str, layers: int | None = None, seq: int | None = None) -> ModelConfig:
    model = load_config([str(ROOT / name)]).config.model
    update = {}
    if layers:
        update["num_layers"] = layers
    if seq:
        update["seq_length"] = seq
    return model.model_copy(update=update)


def vocab_of(name: str) -> int:
    """The file's padded_vocab_size, or the GPT-NeoX-20B tokenizer's padded as the file says."""
    return padded_vocab(load_config([str(ROOT / name)]).config, GPT_NEOX_20B_VOCAB)


def megatron_flops_per_token(cfg: ModelConfig, vocab: int, recompute: bool = False) -> float:
    """Narayanan et al. 2021, eq. 3, per token: 24 L h^2 (1 + s / 6h) a forward pass of the
    layers, three passes (four with full recomputation), plus 6 h V for the logits."""
    L, h, s = cfg.num_layers, cfg.hidden_size, cfg.seq_length
    passes = 4 if recompute else 3
    return passes * 24 * L * h * h * (1 + s / (6 * h)) + 6 * h * vocab


def torchtitan_flops_per_token(cfg: ModelConfig, vocab: int) -> float:
    """6 N' + 12 L h s with N' the parameters less the embedding tables (torchtitan's
    `get_num_params(exclude_embedding=True)`)."""
    embeddings = vocab * cfg.hidden_size
    if cfg.pos_emb == "learned":
        embeddings += cfg.shape.position_rows * cfg.hidden_size
    n = count_parameters(cfg, vocab) - embeddings
    width = cfg.num_attention_heads * cfg.shape.head_dim
    return 6 * n + 12 * cfg.num_layers * width * cfg.seq_length


def compare(cfg: ModelConfig, vocab: int, recompute: bool = False) -> dict[str, float]:
    """FLOPs per token by each formula; Megatron's counts recomputation when the run does."""
    return {
        "neox": float(train_flops_per_token(cfg, vocab)),
        "megatron": megatron_flops_per_token(cfg, vocab, recompute),
        "torchtitan": torchtitan_flops_per_token(cfg, vocab),
    }


def table() -> list[str]:
    """The markdown rows of docs/benchmarks.md's comparison."""
    rows = [
        "| run | tokens/s | neox GFLOPs/token, MFU | Megatron | torchtitan |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, seq, tp, pp, gpus, tps, recompute, source in RUNS:
        layers = LAYERS.get((name, tps))
        cfg = model_of(name, layers, seq)
        flops = compare(cfg, vocab_of(name), recompute)
        cells = [
            f"{f / 1e9:.1f}, {tps * f / gpus / 1e12 / PEAK_TFLOPS:.1%}" for f in flops.values()
        ]
        shape = f"{Path(name).stem}{f' at {layers} layers' if layers else ''}"
        layout = f"TP{tp} x PP{pp}" if pp > 1 else f"TP{tp} x DP{gpus // tp}"
        ac = ", act. ckpt" if recompute else ""
        rows.append(f"| {shape} {layout}{ac} ({source}) | {tps:,} | " + " | ".join(cells) + " |")
    return rows


def shapes_table() -> list[str]:
    """FLOPs per token of the shapes in SHAPES, at their own seq_length, by each formula."""
    rows = [
        "| shape (seq) | neox GFLOPs/token | Megatron | torchtitan |",
        "| --- | --- | --- | --- |",
    ]
    for name in SHAPES:
        cfg = model_of(name)
        flops = compare(cfg, vocab_of(name))
        ratio = [f"{flops[k] / 1e9:.2f} ({flops[k] / flops['neox']:.3f}x)" for k in flops]
        rows.append(
            f"| {name} ({cfg.seq_length}) | {flops['neox'] / 1e9:.2f} | {ratio[1]} | {ratio[2]} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    print("\n".join(table()) + "\n")
    print("\n".join(shapes_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
