from pathlib import Path

import pytest

from neox.config import load_config
from neox.config.docs import render

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.relative_to(ROOT) for p in (ROOT / "configs").rglob("*.yml"))

# Today's base models: config -> the parameters of the Hugging Face model it describes
# (transformers' num_parameters(), tied embeddings counted once).
FAMILIES = {
    "configs/llama3/1B.yml": 1_235_814_400,  # Llama-3.2-1B
    "configs/llama3/3B.yml": 3_212_749_824,  # Llama-3.2-3B
    "configs/llama3/8B.yml": 8_030_261_248,  # Llama-3.1-8B
    "configs/mistral/7B.yml": 7_241_732_096,  # Mistral-7B-v0.1
    "configs/qwen2.5/0-5B.yml": 494_032_768,  # Qwen2.5-0.5B
    "configs/qwen2.5/7B.yml": 7_615_616_512,  # Qwen2.5-7B
    "configs/qwen3/0-6B.yml": 596_049_920,  # Qwen3-0.6B
    "configs/qwen3/8B.yml": 8_190_735_360,  # Qwen3-8B
    "configs/mixtral/8x7B.yml": 46_702_792_704,  # Mixtral-8x7B-v0.1
    "configs/qwen3/30B-A3B.yml": 30_532_122_624,  # Qwen3-30B-A3B
    "configs/olmoe/1B-7B.yml": 6_919_161_856,  # OLMoE-1B-7B-0924
}


@pytest.mark.parametrize("name", [str(p) for p in SHIPPED])
def test_every_shipped_config_loads(name):
    load_config([str(ROOT / name)])


def test_shipped_families_are_present():
    names = {str(p) for p in SHIPPED}
    for expected in [
        "configs/pythia/14M.yml",
        "configs/pythia/12B.yml",
        "configs/125M.yml",
        "configs/20B.yml",
        "configs/llama2/7B.yml",
        *FAMILIES,
        "configs/tiny.yml",
        "configs/local_setup.yml",
        "configs/cpu.yml",
    ]:
        assert expected in names


def test_docs_are_fresh():
    docs = (ROOT / "docs" / "config.md").read_text()
    assert docs == render(), "docs/config.md is stale: python -m neox.config.docs > docs/config.md"


@pytest.mark.parametrize("name", FAMILIES)
def test_family_config_dry_runs_with_the_real_parameter_count(name, capsys, monkeypatch, tmp_path):
    """deepy.py --dry-run (in process) validates it, on 8 planned GPUs, and its estimate counts
    exactly the parameters of the HF model (tests/hf/test_hf_import.py checks the keys
    against the real config.json)."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(ROOT)
    sys.modules.pop("deepy", None)
    import deepy

    gpus = tmp_path / "eight.yml"
    gpus.write_text("num_gpus: 8\n")
    assert deepy.main(["train.py", name, str(gpus), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{FAMILIES[name]:,} total" in out, out.split("# estimate", 1)[1][:600]
    assert "ZeRO-1" in out and "tokens/s" in out
