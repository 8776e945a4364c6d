import pytest

from dsflash.gates.run import engine_scores, gate_ids, reference_scores
from dsflash.runtime.spec import EngineSpec
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


def gate_spec(**kw) -> EngineSpec:
    """An engine spec as the gate tests score it: the reference's model (no fake-quant points), bfp4_b experts
    unless a test asks for another format."""
    return EngineSpec(**{"qat": False, "expert_format": "bfp4_b", **kw})


def bfp8_at_every_tp(setup, cache, degrees=(1, 2, 4), **kw):
    """(tp, the engine's scores) at every TP degree of `degrees` the fixture's heads allow, bfp8_b experts, as few
    slots as a token activates (so the LRU evicts); each degree replaces the module's store."""
    files, ids, prefill, _ = setup
    n_active = files.ckpt.config.num_experts_per_tok
    for tp in [d for d in degrees if files.ckpt.config.num_attention_heads % d == 0]:
        spec = gate_spec(
            tp=tp, expert_slots=n_active, expert_format="bfp8_b", cache_dir=cache, rebuild_store=True, **kw
        )
        yield tp, engine_scores(files, ids, prefill, spec)
