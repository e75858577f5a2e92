"""export_to_hf streams: the checkpoint's files are read and mapped a block at a time and each
safetensors shard is written once full, giving the files the whole-model export gave, byte for
byte, while holding about one shard."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import save_file

from neox.checkpoint.consolidate import load_model_state
from neox.checkpoint.writer import write_checkpoint
from neox.config import load_dict
from neox.hf.export import export_dtype, export_to_hf, shard_bytes
from neox.hf.mapping import to_hf_state_dict
from neox.model import build_model
from tests.process_helpers import child_env
from tests.train_helpers import ROOT

KEYS = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=2,
    intermediate_size=384,
    pos_emb="rotary",
    norm="rmsnorm",
    activation="swiglu",
    no_weight_tying=True,
    tokenizer_type="CharLevelTokenizer",
    padded_vocab_size=512,
)
NEOX_KEYS = dict(
    KEYS,
    num_kv_heads=None,
    norm="layernorm",
    activation="gelu",
    intermediate_size=None,
    gpt_j_residual=True,
    gpt_j_tied=True,
)
# Qwen2: q/k/v biases, no output or MLP biases.
QWEN2_KEYS = dict(KEYS, use_bias_in_attn_dense=False, use_bias_in_mlp=False)


def whole_model_export(ckpt, out, arch, precision, max_shard_size):
    """The export as it was before streaming: the whole state dict read, mapped and cast, then
    split into shards in order, a tensor starting a new shard when it would overflow one."""
    cfg, sd = load_model_state(ckpt)
    dtype = export_dtype(precision, cfg)
    hf_sd = to_hf_state_dict(sd, cfg.model, 512, arch)
    hf_sd = {k: v.to(dtype).contiguous() for k, v in hf_sd.items()}
    max_bytes = shard_bytes(max_shard_size)
    shards, size = [{}], 0
    for name, tensor in hf_sd.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    out.mkdir()
    if len(shards) == 1:
        save_file(hf_sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in hf_sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# name: (keys, tp, pp, architecture, precision, max_shard_size)
CASES = {
    "flat_tp1_one_file": (KEYS, 1, 1, "llama", "auto", "5GB"),
    "tp2_sharded": (KEYS, 2, 1, "llama", "auto", "60KB"),
    "tp2_pp2_bf16": (QWEN2_KEYS, 2, 2, "qwen2", "bf16", "50KB"),
    "pp2_gpt_j_tied_neox": (NEOX_KEYS, 1, 2, "neox", "fp16", "40KB"),
}


@pytest.mark.parametrize("case", CASES)
def test_streamed_export_is_byte_identical_to_the_whole_model_one(case, tmp_path):
    keys, tp, pp, arch, precision, size = CASES[case]
    flat = dict(keys, model_parallel_size=tp, **({"pipe_parallel_size": pp} if pp > 1 else {}))
    cfg = load_dict(flat)
    sd = build_model(cfg.model, 512, seed=5).state_dict()
    write_checkpoint(sd, cfg, tmp_path / "ckpt")
    export_to_hf(
        tmp_path / "ckpt",
        tmp_path / "hf",
        architecture=arch,
        precision=precision,
        max_shard_size=size,
    )
    internal = {"neox": "gpt_neox"}.get(arch, arch)
    whole_model_export(tmp_path / "ckpt", tmp_path / "whole", internal, precision, size)
    expected = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert len(expected) > (3 if size != "5GB" else 0)
    weights = sorted(p.name for p in (tmp_path / "hf").iterdir() if "safetensors" in p.name)
    assert weights == expected
    for name in expected:
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    assert not [p for p in (tmp_path / "hf").iterdir() if "partial" in p.name]


def test_each_file_is_mapped_once_per_block(tmp_path, monkeypatch):
    """A one-file checkpoint (tp=1: every tensor in one file) is mapped once per block, not once
    per tensor: each mapping unpickles the whole file's index, which per tensor made the time
    grow with the square of the tensor count."""
    from neox.checkpoint import consolidate

    cfg = load_dict(KEYS)
    write_checkpoint(build_model(cfg.model, 512, seed=5).state_dict(), cfg, tmp_path / "ckpt")
    mapped = []
    real = consolidate._mapped
    monkeypatch.setattr(
        consolidate, "_mapped", lambda path, trust: mapped.append(path) or real(path, trust)
    )
    export_to_hf(tmp_path / "ckpt", tmp_path / "hf", architecture="llama")
    names = [n for n in load_model_state(tmp_path / "ckpt")[1]]
    blocks = len(consolidate.layer_groups(names))
    assert len(set(mapped)) == 1 and len(names) > 2 * blocks
    assert len(mapped) == 1 + blocks, (len(mapped), blocks, len(names))  # 1: the plan's read


# A child process: a tiny export first (the imports and first-call costs), then the peak RSS
# of exporting the real model over what was resident before it. Large allocations are
# mmap'd so that freed memory leaves the process and the peak counts only live bytes (and
# the checkpoint's mapped pages).
CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from neox.hf.export import export_to_hf
    work, shard = Path(sys.argv[1]), sys.argv[2]
    export_to_hf(work / "tiny", work / "warm", architecture="llama", max_shard_size=shard)
    def status(key):
        line = [l for l in open("/proc/self/status") if l.startswith(key + ":")][0]
        return int(line.split()[1]) * 1024
    open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
    before = status("VmRSS")
    export_to_hf(work / "big", work / "hf", architecture="llama", max_shard_size=shard)
    print(json.dumps({"peak": status("VmHWM") - before}))
    """
)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc")
def test_peak_memory_stays_near_one_shard(tmp_path):
    """A 39 MB model (16 blocks of 2.4 MB, tp=2 so each block is joined from two files) exported
    in 8 MB shards: the export holds the shard being filled, one block and the few MB of the
    plan (names, shapes, file offsets), not the model (the whole-model read held twice it)."""
    big = load_dict(
        dict(KEYS, num_layers=16, hidden_size=256, intermediate_size=1536, model_parallel_size=2)
    )
    sd = build_model(big.model, 512, seed=1).state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    write_checkpoint(sd, big, tmp_path / "big")
    del sd
    tiny = load_dict(dict(KEYS, num_layers=1, hidden_size=32, intermediate_size=96))
    write_checkpoint(build_model(tiny.model, 512, seed=1).state_dict(), tiny, tmp_path / "tiny")
    env = child_env(MALLOC_MMAP_THRESHOLD_="16384")
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), "8MB"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    peak = json.loads(r.stdout.strip().splitlines()[-1])["peak"]
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    largest = max(p.stat().st_size for p in shards)
    assert model_bytes > 38e6 and len(shards) >= 5 and largest <= 8.1e6
    assert peak < 2.5 * largest, (peak, largest, model_bytes)
