import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

# tests never touch the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA
