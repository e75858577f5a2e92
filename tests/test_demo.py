"""`make demo`'s stages through deepy.py, with its shipped configs (configs/tiny.yml,
configs/cpu.yml, configs/demo/*.yml) on a small dataset and a few steps: train, evaluate,
generate, export to Hugging Face and verify the export with transformers."""

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.train_helpers import ROOT, deepy_env, make_dataset, run_deepy

pytestmark = pytest.mark.slow

DEMO = ["configs/tiny.yml", "configs/cpu.yml"]
COMPILERS = ("cc", "c++", "gcc", "g++", "clang", "clang++", "ninja")


def no_compiler(tmp_path: Path) -> dict[str, str]:
    """An environment in which every C/C++ compiler (and ninja) found on PATH fails and notes
    its call in tmp_path/compiler-calls, and torch's extension cache is an empty directory."""
    shims = tmp_path / "no-compiler"
    shims.mkdir()
    for name in COMPILERS:
        (shims / name).write_text(f'#!/bin/sh\necho "$0 $*" >> {tmp_path}/compiler-calls\nexit 1\n')
        (shims / name).chmod(0o755)
    (tmp_path / "torch-extensions").mkdir()
    return dict(
        PATH=f"{shims}{os.pathsep}{os.environ['PATH']}",
        CC=str(shims / "cc"),
        CXX=str(shims / "c++"),
        TORCH_EXTENSIONS_DIR=str(tmp_path / "torch-extensions"),
    )


def said_once(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Asserts that a 2-rank launch says each thing once: no line twice (timestamps aside; JSON's
    bare braces say nothing), nothing from rank 1 (a healthy rank speaks only of its problems),
    and a short launch line (the config it hands over is not printed)."""
    lines = [
        re.sub(r"^\d{4}-\d\d-\d\d [\d:,]+ ", "", x) for x in (r.stdout + r.stderr).splitlines()
    ]
    twice = [x for x, n in Counter(x for x in lines if re.search(r"\w", x)).items() if n > 1]
    assert not twice, twice
    assert not [x for x in lines if x.startswith("rank 1 ")], lines
    (launch,) = [x for x in lines if x.startswith("deepy: launching 2 rank(s)")]
    assert len(launch) < 200 and "--neox_config" not in launch, launch
    return r


def test_demo_stages_train_evaluate_generate_and_export(tmp_path, bpe_tokenizer):
    make_dataset(tmp_path / "data" / "demo", docs=200)
    paths = dict(
        data_path=str(tmp_path / "data" / "demo"),
        vocab_file=str(bpe_tokenizer),
        save=str(tmp_path / "ckpt dir"),  # a space, on its way to the ranks and back
        load=str(tmp_path / "ckpt dir"),
        log_dir=str(tmp_path / "logs"),
        tensorboard_dir=str(tmp_path / "tb"),
        sample_output_file=str(tmp_path / "samples.jsonl"),
        train_iters=4,
    )
    here = tmp_path / "here.yml"  # layered last, as the paths of a checkout
    here.write_text(yaml.safe_dump(paths))

    env = no_compiler(tmp_path)  # the launches compile nothing: DeepSpeed's shm op is never built
    r = said_once(run_deepy("train.py", *DEMO, here, **env))
    assert f"full config: {tmp_path / 'logs' / 'config.yml'}" in r.stderr
    assert (tmp_path / "ckpt dir" / "latest").read_text() == "global_step4"

    r = said_once(run_deepy("eval.py", *DEMO, "configs/demo/eval.yml", here, **env))
    (results,) = (tmp_path / "logs").glob("demo_eval_results_*.json")
    test = json.loads(results.read_text())["results"]["test"]
    assert math.isfinite(test["perplexity"]) and 0 < test["bits_per_byte"] < 100
    assert '"bits_per_byte"' in r.stdout

    said_once(run_deepy("generate.py", *DEMO, "configs/demo/generate.yml", here, **env))
    prompts = [p for p in (ROOT / "configs/demo/prompts.txt").read_text().splitlines() if p]
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [x["context"] for x in rows] == prompts
    assert all(0 < x["length"] <= 48 for x in rows)

    hf = tmp_path / "hf"
    args = ["--input_dir", tmp_path / "ckpt dir", "--output_dir", hf, "--overwrite", "--verify"]
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_to_hf.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=deepy_env(**env),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (hf / "model.safetensors").is_file() and (hf / "tokenizer.json").is_file()
    assert not (tmp_path / "compiler-calls").exists(), (tmp_path / "compiler-calls").read_text()
    assert list((tmp_path / "torch-extensions").iterdir()) == []
