import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# Tests run on CPU: DeepSpeed's CPU accelerator and the gloo backend.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# On pytest-xdist workers (`make test`) every process, the ranks and deepy.py's children included,
# gets one OpenMP thread: with one per core in each of several processes, spinning threads
# oversubscribe the cores and a tiny training loop runs many times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# First: pytest-xdist's worker hook, registered after this file, reads the groups to name the
# tests it schedules (a group marked after it is ignored and its fixture built on each worker).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (run them alone with `pytest -m gpu`) are skipped without CUDA, those
    marked `two_gpus` with fewer than 2 CUDA GPUs, `multigpu` (`pytest -m multigpu`) with fewer
    than 4; the groups and order for pytest-xdist workers are set first."""
    group_for_xdist(items)
    for mark, gpus in (("two_gpus", 2), ("multigpu", 4)):
        if torch.cuda.device_count() < gpus:
            few = pytest.mark.skip(reason=f"needs {gpus} CUDA GPUs")
            for item in items:
                if item.get_closest_marker(mark):
                    item.add_marker(few)
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)


def group_for_xdist(items) -> None:
    """`make test` runs the tests on pytest-xdist workers (`--dist loadgroup`). Tests that share
    an expensive fixture run on one worker, so that it is built once: the layout matrix (the
    session's `trained` below) in group "layouts"; a module-scoped fixture of tests/ (a training
    run, sshd, a slurm cluster) in a group per module. Everything else is spread test by test.
    Under xdist the long work is queued first (`--no-loadscope-reorder` keeps this order): the
    groups, then the tests marked slow, so that the run ends on short tests on every worker.
    A module's own `xdist_group` mark is kept."""
    for item in items:
        marked = item.get_closest_marker("xdist_group")
        group = marked.args[0] if marked else fixture_group(item)
        if group:
            if not marked:
                item.add_marker(pytest.mark.xdist_group(group))
            name_group(item, group)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: collection order, each module's tests together

    def queue(item) -> tuple[int, int]:
        group = item.get_closest_marker("xdist_group")
        if group:
            return (0, group.args[0] != "layouts")  # the largest group first
        return (1, not item.get_closest_marker("slow"))

    items.sort(key=queue)


def fixture_group(item) -> str | None:
    group = None
    for name in item.fixturenames:
        defs = item._fixtureinfo.name2fixturedefs.get(name)
        if not defs or not defs[-1].baseid.startswith("tests"):
            continue  # pytest's own fixtures (tmp_path_factory, ...)
        if name == "trained" and defs[-1].baseid == "tests":
            return "layouts"
        if defs[-1].scope in ("module", "package"):
            group = item.nodeid.split("::")[0]
    return group


def name_group(item, group: str) -> None:
    """The scheduler reads a test's group from its id, `NODEID@GROUP`, which pytest-xdist's
    worker appends by setting `item._nodeid`; pytest 9.2 keeps the id in `item._id`, so the
    suffix was lost and every group's tests spread over the workers (each building the fixture).
    Named here where pytest stores it that way."""
    if hasattr(item, "_nodeid") or not getattr(item.config.option, "loadgroup", False):
        return  # older pytest: xdist's own hook names it
    from _pytest.nodeid import NodeId

    item._id = NodeId.parse(f"{item.nodeid}@{group}")


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
    from tests.layout_helpers import bpe_tokenizer

    return bpe_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def trained(tmp_path_factory, bpe_tokenizer):
    """The parallel layouts of tests/layout_helpers.py, each trained once per session on first use."""
    from tests.layout_helpers import TrainedRuns

    return TrainedRuns(tmp_path_factory.mktemp("layouts"), bpe_tokenizer)
