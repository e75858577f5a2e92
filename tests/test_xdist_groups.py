"""tests/conftest.py's groups reach pytest-xdist's scheduler (`make test`): a test that shares a
module fixture, or carries its module's own group mark, is scheduled by `NODEID@GROUP`. Under
pytest 9.2 the suffix was silently lost and each worker built every shared fixture."""

import os
import subprocess
import sys

import pytest

from tests.train_helpers import ROOT

pytestmark = pytest.mark.slow

LORA = "tests/checkpoint/test_lora.py"
MPI_SLURM = "tests/launcher/test_launchers_mpi_slurm.py"


def test_shared_fixtures_and_group_marks_name_the_group_the_scheduler_reads():
    # --setup-plan: the workers collect and schedule, nothing is set up or run.
    cmd = [sys.executable, "-m", "pytest", "-n", "1", "--dist", "loadgroup", "-v"]
    cmd += ["--setup-plan", "-p", "no:cacheprovider", LORA, MPI_SLURM]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 5), r.stdout[-3000:] + r.stderr[-3000:]
    ids = {line.split()[0] for line in r.stdout.splitlines() if line.startswith("tests/")}
    lora = {i for i in ids if i.startswith(LORA)}
    # Every LoRA test but one reads the module's trained runs; that one is spread alone.
    assert len(lora) == 9, r.stdout[-3000:]
    alone = {i for i in lora if "@" not in i}
    assert alone == {f"{LORA}::test_peft_adapter_for_llama_splits_the_fused_qkv"}
    assert all(i.endswith(f"@{LORA}") for i in lora - alone)
    slurm = {i for i in ids if i.startswith(MPI_SLURM)}
    assert len(slurm) == 10 and all(i.endswith("@mpi_slurm") for i in slurm), slurm
