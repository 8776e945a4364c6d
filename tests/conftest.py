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


# `make test` hands whole files to its workers in collection order, so a slow file handed out last keeps one worker
# busy while the other idles: the slowest files (measured with --durations) go first, the rest keep their order
SLOWEST_FIRST = (
    "runtime/test_prefix.py",
    "runtime/test_engine_tp.py",
    "server/test_lifecycle.py",
    "runtime/test_speculative.py",
    "runtime/test_graph_decode.py",
    "server/test_bench.py",
    "model/test_incremental.py",
    "server/test_backends.py",
    "unit/test_triton_linear.py",
    "runtime/test_engine_resources.py",
    "model/test_golden.py",
    "runtime/test_torchrun.py",
    "server/test_prefix_restart.py",
    "server/test_batching.py",
    "model/test_logits_cli.py",
    "runtime/test_prefix_disk.py",
    "runtime/test_batch.py",
    "server/test_http.py",
    "server/test_fuzz.py",
)


def pytest_collection_modifyitems(items):
    tests = Path(__file__).parent
    missing = [name for name in SLOWEST_FIRST if not (tests / name).is_file()]
    assert not missing, f"tests/conftest.py SLOWEST_FIRST names files that are gone: {missing}"
    rank = {tests / name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path), len(rank)))  # stable: within a file, the order stays
