from pathlib import Path

import pytest

from neox.config import load_config
from neox.config.docs import render

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.relative_to(ROOT) for p in (ROOT / "configs").rglob("*.yml"))


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
        "configs/tiny.yml",
        "configs/local_setup.yml",
        "configs/cpu.yml",
    ]:
        assert expected in names


def test_docs_are_fresh():
    docs = (ROOT / "docs" / "config.md").read_text()
    assert docs == render(), "docs/config.md is stale: python -m neox.config.docs > docs/config.md"
