"""The README's "Finetuning in five commands", run as written (its shipped configs and relative
paths) in a scratch directory: a tiny HF model made locally, imported, chat data preprocessed,
LoRA SFT on 2 CPU ranks (4 steps instead of 40), generation, and a PEFT export that transformers
and peft load. Each stage is checked for what it should have written."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from neox.checkpoint.plain_state import plain_state_dict
from tests.train_helpers import ROOT, deepy_env

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

MODEL = "checkpoints/tiny-chat/model.yml"
LORA = "configs/finetune/lora_sft.yml"


def run(cwd, *args) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=deepy_env(),
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


def test_finetuning_walkthrough(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from neox.data.indexed import IndexedDataset

    # The commands run where the README runs them, a checkout: the configs they name are copied
    # beside the outputs; the scripts are this checkout's.
    (tmp_path / "configs" / "demo").mkdir(parents=True)
    shutil.copytree(ROOT / "configs" / "finetune", tmp_path / "configs" / "finetune")
    shutil.copy(ROOT / "configs" / "cpu.yml", tmp_path / "configs")
    shutil.copy(ROOT / "configs" / "demo" / "chat.jsonl", tmp_path / "configs" / "demo")
    short = tmp_path / "short.yml"  # 4 steps and one checkpoint instead of the README's 40
    short.write_text(yaml.safe_dump(dict(train_iters=4, checkpoint_factor=4, eval_interval=4)))

    # a tiny random Qwen2 and its ChatML tokenizer
    run(tmp_path, ROOT / "tools/make_tiny_hf_model.py", "hf/tiny-chat", "--family", "qwen2")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf/tiny-chat")
    chat = [{"role": "user", "content": "Add one and two."}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nAdd one and two.<|im_end|>\n<|im_start|>assistant\n"

    # 1. import
    out = "checkpoints/tiny-chat"
    run(
        tmp_path,
        ROOT / "tools/convert_from_hf.py",
        "--input_dir",
        "hf/tiny-chat",
        "--output_dir",
        out,
    )
    keys = yaml.safe_load((tmp_path / MODEL).read_text())
    assert keys["finetune"] is True and keys["hf_architecture"] == "qwen2"

    # 2. chat data: labels train the assistant turns (and the closing EOS) only
    (tmp_path / "data/chat").mkdir(parents=True)
    run(
        tmp_path,
        ROOT / "tools/preprocess_data_with_chat_template.py",
        *("--input", "configs/demo/chat.jsonl", "--output-prefix", "data/chat/chat"),
        *("--tokenizer-path", "checkpoints/tiny-chat/hf", "--jsonl-keys", "messages"),
    )
    tokens = IndexedDataset(str(tmp_path / "data/chat/chat_messages_document"))
    labels = IndexedDataset(str(tmp_path / "data/chat/chat_messages_label_document"))
    assert len(tokens) == len(labels) == 50
    first = json.loads((tmp_path / "configs/demo/chat.jsonl").read_text().splitlines()[0])
    t, lab = np.asarray(tokens[0]), np.asarray(labels[0])
    trained = lab != -100
    assert 0 < trained.sum() < len(t) and np.array_equal(lab[trained], t[trained])
    trained_text = tok.decode(t[trained].tolist())
    for turn in first["messages"]:
        assert (turn["content"] in trained_text) == (turn["role"] == "assistant"), turn

    # 3. LoRA SFT: the checkpoint holds the adapters alone and names its base
    run(tmp_path, ROOT / "deepy.py", ROOT / "train.py", MODEL, LORA, "configs/cpu.yml", short)
    ckpt = tmp_path / "checkpoints/tiny-chat-lora"
    assert (ckpt / "latest").read_text() == "global_step4"
    base = json.loads((ckpt / "global_step4/lora_base.json").read_text())
    assert base["lora_rank"] == 8 and base["base"].endswith("tiny-chat/global_step0")
    adapters = plain_state_dict(ckpt / "global_step4")
    assert adapters and all(".lora_" in k for k in adapters)
    metrics = [json.loads(x) for x in (tmp_path / "logs/tiny-chat-lora/metrics.jsonl").open()]
    assert any(m["split"] == "train" and m["step"] == 4 for m in metrics)

    # 4. generate from the adapter checkpoint
    gen = "configs/finetune/generate.yml"
    run(tmp_path, ROOT / "deepy.py", ROOT / "generate.py", MODEL, LORA, gen)
    rows = [json.loads(x) for x in (tmp_path / "logs/tiny-chat-lora/samples.jsonl").open()]
    assert len(rows) == 2 and all(r["context"].endswith("assistant\n") for r in rows)
    assert all(0 < r["length"] <= 24 or r["finished"] for r in rows)

    # 5. PEFT export, verified against neox; it loads with peft and the adapter changes logits
    run(
        tmp_path,
        ROOT / "tools/convert_to_hf.py",
        *("--input_dir", "checkpoints/tiny-chat-lora", "--output_dir", "hf/tiny-chat-lora"),
        *("--lora_format", "peft", "--verify"),
    )
    hf = tmp_path / "hf/tiny-chat-lora"
    adapter = json.loads((hf / "adapter/adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((tmp_path / "hf/tiny-chat").resolve())
    base_model = AutoModelForCausalLM.from_pretrained(hf).eval()
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        before = base_model(ids).logits
        tuned = PeftModel.from_pretrained(base_model, hf / "adapter").eval()
        after = tuned(ids).logits
    assert not torch.allclose(before, after)
