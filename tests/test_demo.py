"""`make demo`'s stages through deepy.py, with its shipped configs (configs/tiny.yml,
configs/cpu.yml, configs/demo/*.yml) on a small dataset and a few steps: train, evaluate,
generate, export to Hugging Face and verify the export with transformers."""

import json
import math
import subprocess
import sys

import pytest
import yaml

from tests.train_helpers import ROOT, make_dataset, run_deepy

pytestmark = pytest.mark.slow

DEMO = ["configs/tiny.yml", "configs/cpu.yml"]


def test_demo_stages_train_evaluate_generate_and_export(tmp_path, bpe_tokenizer):
    make_dataset(tmp_path / "data" / "demo", docs=200)
    paths = dict(
        data_path=str(tmp_path / "data" / "demo"),
        vocab_file=str(bpe_tokenizer),
        save=str(tmp_path / "ckpt"),
        load=str(tmp_path / "ckpt"),
        log_dir=str(tmp_path / "logs"),
        tensorboard_dir=str(tmp_path / "tb"),
        sample_output_file=str(tmp_path / "samples.jsonl"),
        train_iters=4,
    )
    here = tmp_path / "here.yml"  # layered last, as the paths of a checkout
    here.write_text(yaml.safe_dump(paths))

    run_deepy("train.py", *DEMO, here)
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"

    r = run_deepy("eval.py", *DEMO, "configs/demo/eval.yml", here)
    (results,) = (tmp_path / "logs").glob("demo_eval_results_*.json")
    test = json.loads(results.read_text())["results"]["test"]
    assert math.isfinite(test["perplexity"]) and 0 < test["bits_per_byte"] < 100
    assert '"bits_per_byte"' in r.stdout

    run_deepy("generate.py", *DEMO, "configs/demo/generate.yml", here)
    prompts = [p for p in (ROOT / "configs/demo/prompts.txt").read_text().splitlines() if p]
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [x["context"] for x in rows] == prompts
    assert all(0 < x["length"] <= 48 for x in rows)

    hf = tmp_path / "hf"
    args = ["--input_dir", tmp_path / "ckpt", "--output_dir", hf, "--overwrite", "--verify"]
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_to_hf.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (hf / "model.safetensors").is_file() and (hf / "tokenizer.json").is_file()
