"""Peak host memory and time of tools/convert_from_hf.py on an 8B-shaped HF checkpoint.

Builds a Llama-3.1-8B-shaped directory (config.json of the real model's shape, bf16 weights
of random values, split like transformers' 5GB shards with model.safetensors.index.json)
without ever holding a shard in memory, then runs the converter as the user does (a child
process, `--tp 2`) and reports its peak RSS against the largest shard. The baseline is a child
that only imports what the converter imports.

    python benchmarks/hf_import_memory.py --work /tmp/hf8b [--layers 32] [--tp 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import child_env, emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Llama-3.1-8B's config.json.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
SHARD_BYTES = 5 * 10**9


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The HF names and shapes of a Llama, in the order transformers saves them."""
    h, kv = (
        c["hidden_size"],
        c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"],
    )
    ffn = c["intermediate_size"]
    out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (ffn, h)),
            (p + "mlp.up_proj.weight", (ffn, h)),
            (p + "mlp.down_proj.weight", (h, ffn)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]
    return out


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int) -> int:
    """A bf16 safetensors file of random values, written one tensor at a time (the format:
    8-byte little-endian header length, JSON header of dtypes, shapes and byte ranges, data)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        nbytes = 2 * torch.Size(shape).numel()
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator().manual_seed(seed)
    # A random block of 16M values written over and over: random-looking weights at disk
    # speed (drawing 8B normal values takes minutes on a small CPU).
    block = (torch.randn(1 << 24, generator=gen) * 0.02).to(torch.bfloat16)
    data = block.view(torch.uint8).numpy()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _, shape in tensors:
            left = 2 * torch.Size(shape).numel()
            start = int(torch.randint(0, len(data) // 2, (), generator=gen)) * 2
            while left:
                piece = data[start : start + left]
                f.write(piece)
                left -= len(piece)
                start = 0
    return path.stat().st_size


def build(hf_dir: Path, layers: int) -> list[int]:
    """The sharded directory; returns the shard sizes in bytes."""
    config = dict(CONFIG, num_hidden_layers=layers)
    hf_dir.mkdir(parents=True)
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    shards, size = [[]], 0
    for name, shape in tensor_shapes(config):
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    sizes, weight_map = [], {}
    for i, (file, tensors) in enumerate(zip(files, shards)):
        sizes.append(write_safetensors(hf_dir / file, tensors, seed=i))
        weight_map.update({name: file for name, _ in tensors})
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sizes


# Runs a script as __main__, then prints its process's VmHWM: the peak RSS of the memory map
# exec made (ru_maxrss would also count the parent's pages the fork copied before exec).
PEAK = """
import runpy, sys
script, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
    print("PEAK_RSS_KIB", int(hwm.split()[1]), flush=True)
"""


def child_peak_rss(argv: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of a child running the script argv[0] with argv[1:]."""
    env = child_env()
    start = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", PEAK, *argv], env=env, cwd=ROOT, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{argv} failed ({r.returncode}): {r.stderr[-2000:]}")
    peak = [line for line in r.stdout.splitlines() if line.startswith("PEAK_RSS_KIB")][-1]
    return int(peak.split()[1]) * 1024, seconds


def check_sample(hf_dir: Path, out: Path, tp: int) -> int:
    """Compare the first and last blocks and everything outside the blocks, converted again
    from the HF files, with the tp rank files read through torch.load(mmap=True) (so > 4 GB
    zip64 offsets are exercised); returns the number of tensors compared."""
    from neox.checkpoint.consolidate import partition_dim
    from neox.config import read_saved_config
    from neox.hf.importer import layer_groups
    from neox.hf.mapping import from_hf_state_dict
    from neox.hf.weights import HFWeights
    from neox.parallel.layers import shard

    cfg = read_saved_config(out / "global_step0" / "config.yml")
    padded = cfg.tokenizer.padded_vocab_size
    ranks = [
        torch.load(
            out / "global_step0" / f"mp_rank_{r:02d}_model_states.pt", mmap=True, weights_only=True
        )["module"]
        for r in range(tp)
    ]
    weights = HFWeights(hf_dir)
    groups = layer_groups(list(weights.meta()))
    blocks = [g for g in groups if len(g) > 1]
    compared = 0
    for names in [g for g in groups if len(g) == 1] + [blocks[0], blocks[-1]]:
        part = from_hf_state_dict(weights.read(names), cfg.model, padded, "llama", False)
        for name, full in part.items():
            dim = partition_dim(name)
            for r in range(tp):
                part = full if dim is None else shard(full, dim, r, tp)
                if not torch.equal(ranks[r][name], part):
                    raise SystemExit(f"{name} differs on tp rank {r}")
                compared += 1
    return compared


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="scratch directory (needs 2x model)")
    p.add_argument("--layers", type=int, default=32, help="blocks (Llama-3.1-8B has 32)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the directories afterwards")
    p.add_argument("--json", help="append the result to this file")
    args = p.parse_args()
    hf_dir, out = args.work / "hf", args.work / "neox"
    shutil.rmtree(args.work, ignore_errors=True)
    t0 = time.perf_counter()
    sizes = build(hf_dir, args.layers)
    built = time.perf_counter() - t0
    tool = str(ROOT / "tools" / "convert_from_hf.py")
    baseline, _ = child_peak_rss([tool, "--help"])  # the imports alone
    peak, seconds = child_peak_rss(
        [tool, "--input_dir", str(hf_dir), "--output_dir", str(out), "--tp", str(args.tp)]
    )
    written = sum(f.stat().st_size for f in (out / "global_step0").glob("*.pt"))
    checked = check_sample(hf_dir, out, args.tp)
    emit(
        {
            "benchmark": "hf_import_memory",
            "layers": args.layers,
            "tp": args.tp,
            "shards": len(sizes),
            "model_bytes": sum(sizes),
            "largest_shard_bytes": max(sizes),
            "written_bytes": written,
            "peak_rss_bytes": peak,
            "baseline_rss_bytes": baseline,
            "peak_over_largest_shard": round(peak / max(sizes), 3),
            "import_seconds": round(seconds, 1),
            "build_seconds": round(built, 1),
            "tensors_checked": checked,
        },
        args.json,
    )
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
