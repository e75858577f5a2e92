import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# Tests run on CPU: DeepSpeed's CPU accelerator and the gloo backend.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Real data from ../shared/data; the test is skipped, saying why, when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (shared/data beside the checkout)")
    return SHARED_DATA
