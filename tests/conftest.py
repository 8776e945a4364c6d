import os
from pathlib import Path

import pytest

from dsflash.paths import kernel_dir

DATA = Path(__file__).parent / "data"

# tests never touch the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# every test and every dsflash process a test starts (each with its own fresh cache) shares one build of the native
# kernels instead of compiling them again per cache
os.environ.setdefault("DSFLASH_KERNELS", str(kernel_dir()))

# without a GPU, the CUDA path's Triton kernels run in Triton's interpreter on CPU tensors (tests/unit/
# test_triton_linear.py); triton reads this when it is first imported, so it is set before any test imports it
if os.environ.get("DSFLASH_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA
