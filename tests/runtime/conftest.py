import pytest

from dsflash.gates.run import gate_ids, reference_scores
from dsflash.service.files import open_dir
from tests.model.conftest import ROOT

GATE_TOKENS = 120  # 80 prefill + 40 teacher-forced decode steps: enough decisive positions on the tiny fixtures


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Expert stores shared by a module's tests."""
    return str(tmp_path_factory.mktemp("stores"))


@pytest.fixture(scope="module", params=["tiny_a", "tiny_b"])
def setup(request):
    """(files, gate token ids, prefill length, the reference's scores) of each tiny fixture."""
    files = open_dir(ROOT / request.param / "model")
    ids, prefill = gate_ids(files, GATE_TOKENS)
    return files, ids, prefill, reference_scores(files, ids, prefill)
