import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

# tests never touch the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# without a GPU, the CUDA path's Triton kernels run in Triton's interpreter on CPU tensors (tests/unit/
# test_triton_linear.py); triton reads this when it is first imported, so it is set before any test imports it
if os.environ.get("DSFLASH_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA
