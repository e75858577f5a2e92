import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# Tests run on CPU: DeepSpeed's CPU accelerator and the gloo backend.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (run them alone with `pytest -m gpu`) are skipped without CUDA."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Real data from ../shared/data; the test is skipped, saying why, when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (shared/data beside the checkout)")
    return SHARED_DATA


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group for code that asks torch.distributed, removed afterwards so
    that later tests in this process start without one."""
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", world_size=1, rank=0)
    yield
    if ours:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory) -> Path:
    from tests.layouts import bpe_tokenizer

    return bpe_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def trained(tmp_path_factory, bpe_tokenizer):
    """The parallel layouts of tests/layouts.py, each trained once per session on first use."""
    from tests.layouts import TrainedRuns

    return TrainedRuns(tmp_path_factory.mktemp("layouts"), bpe_tokenizer)
