"""The reference model against DeepSeek's own V4.1 code on the tiny official-format checkpoints."""

import numpy as np
import pytest
import torch

from dsflash.gates.compare import compare_logits, within_golden_tolerance


def _check(case, got, want):
    tol = case.golden["tolerance"]
    report = compare_logits(want, got, tol["top1_margin"])
    assert within_golden_tolerance(report, tol), report
    return report


def test_prefill_logits(case):
    state = case.ref.model.new_state(len(case.tokens))
    got = case.run(case.tokens, 0, state)[0].numpy()
    _check(case, got, case.load("prefill_logits.npy"))


@pytest.fixture(scope="module")
def decoded(case) -> dict:
    """One decode pass over the golden tokens for both decode tests (each step costs ~0.1-0.2 s of Python): the
    logits of every decode step, and the DSpark head's draft after each, fed the golden sampled token."""
    gold = case.load("dspark.npz")
    model, experts = case.ref.model, case.ref.experts
    state = model.new_state(len(case.tokens))
    P = case.prefill
    _, taps = case.run(case.tokens[:P], 0, state, taps=True)
    seeded = model.draft(torch.tensor([gold["input_ids"][0]]), taps, 0, state, experts)
    rows, drafts = [], []
    for k, pos in enumerate(range(P, len(case.tokens))):
        logits, taps = case.run([case.tokens[pos]], pos, state, taps=True)
        rows.append(logits[0, -1].numpy())
        drafts.append(model.draft(torch.tensor([int(gold["input_ids"][k])]), taps, pos, state, experts))
    return {"gold": gold, "seeded": seeded, "rows": np.stack(rows), "drafts": drafts}


def test_decode_logits(case, decoded):
    _check(case, decoded["rows"], case.load("decode_logits.npy"))


def _prefill_trace(case) -> dict:
    trace: dict = {}
    state = case.ref.model.new_state(len(case.tokens))
    case.run(case.tokens, 0, state, trace=trace)
    return trace


def test_engram_hash_ids_exact(case):
    ids = _prefill_trace(case)["engram_hash_ids"][0].permute(1, 0, 2).numpy()  # [L, T, cols]
    np.testing.assert_array_equal(ids, case.load("engram_hash_ids.npy"))


def test_hidden_states(case):
    trace = _prefill_trace(case)
    layers = torch.stack(trace["layer_states"])[:, 0].numpy()
    np.testing.assert_allclose(layers, case.load("layer_states.npy"), atol=1e-3)
    np.testing.assert_allclose(trace["final_hidden"][0].numpy(), case.load("final_hidden.npy"), atol=1e-3)
    engram = torch.stack(trace["engram_states"])[:, 0].numpy()
    np.testing.assert_allclose(engram, case.load("engram_states.npy"), atol=1e-3)


def test_indexer_candidates_and_routing(case):
    trace = _prefill_trace(case)
    topk = case.load("index_topk.npz")
    for key in topk:
        got = trace["index_topk"][int(key.removeprefix("layer"))][0].numpy()
        want = topk[key]
        assert got.shape == want.shape, key
        assert (got == want).all(axis=-1).mean() >= 0.99, key
    mask = trace["candidate_mask"][0].numpy()
    assert (mask == case.load("candidate_mask.npy")).all(axis=-1).mean() >= 0.99
    routing = case.load("moe_routing.npz")
    n_layers = case.ref.cfg.num_hidden_layers
    ids = np.stack([trace["moe"][i][0].numpy() for i in range(n_layers)])
    weights = np.stack([trace["moe"][i][1].numpy() for i in range(n_layers)])
    same = (ids == routing["ids"]).all(axis=-1)
    assert same.mean() >= 0.99
    np.testing.assert_allclose(weights[same], routing["weights"][same], atol=1e-4)


def test_dspark_drafts(case, decoded):
    """Fed the golden sampled token each step, the draft head drafts the golden ids (>= 95% of steps)."""
    gold, tol = decoded["gold"], case.golden["tolerance"]
    assert decoded["seeded"] is None  # the prefill only seeds the stages' windows
    matched = 0
    for k, (ids, logits, conf) in enumerate(decoded["drafts"]):
        ids = ids[0].numpy()
        matched += bool((ids == gold["output_ids"][k]).all())
        np.testing.assert_allclose(conf[0].numpy(), gold["confidence"][k], atol=tol["max_abs"])
        if k < len(gold["logits"]):
            # row i's Markov bias depends on drafted id i, so compare only while the drafts agree
            for i in range(logits.shape[1]):
                if (ids[1 : i + 1] != gold["output_ids"][k][1 : i + 1]).any():
                    break
                diff = np.abs(logits[0, i].numpy() - gold["logits"][k][i])
                assert diff.max() <= tol["max_abs"] and diff.mean() <= tol["mean_abs"]
    assert matched / len(decoded["drafts"]) >= 0.95
