"""The simulator's traces, step-time rules and calibration against the reference box."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dsflash.bench.datasets import PRESETS
from dsflash.errors import ConfigError
from dsflash.sim.box import BASELINE, MEASURED, REFERENCE, REFERENCE_LOCALITY, WORKLOADS, Box, Locality, Policy
from dsflash.sim.model import Machine
from dsflash.sim.run import Simulator
from dsflash.sim.traces import RequestTrace, SyntheticRouting, draw_without_replacement, load_recorded
from dsflash.sim.whatif import concurrency, concurrency_markdown, speculation, speculation_markdown


def test_workloads_match_the_bench_presets():
    for name, wl in WORKLOADS.items():
        p = PRESETS[name]
        assert (wl.input_len, wl.output_len, wl.profile, wl.context) == (p.input_len, p.output_len, p.profile,
                                                                          p.context)  # fmt: skip
    assert set(MEASURED) == set(WORKLOADS)


def test_draws_without_replacement_follow_the_weights():
    rng = np.random.default_rng(0)
    w = np.array([0.5, 0.3, 0.15, 0.05])
    ids = draw_without_replacement(rng, w, 40000, 1)
    assert np.allclose(np.bincount(ids[:, 0], minlength=4) / 40000, w, atol=0.01)
    two = draw_without_replacement(rng, w, 40000, 2)
    assert (two[:, 0] != two[:, 1]).all()
    # P(first two are {0, 1}) under sequential draws: .5*.3/.5 + .3*.5/.7
    pair = ((np.sort(two, axis=1) == [0, 1]).all(axis=1)).mean()
    assert pair == pytest.approx(0.5 * 0.3 / 0.5 + 0.3 * 0.5 / 0.7, abs=0.01)


def test_synthetic_requests_are_reproducible_and_local():
    r = SyntheticRouting(4, 64, 6, Locality(zipf=1.2, request_sigma=1.0, reuse=0.5, seed=3))
    a, b, c = r.request(50, 10, index=0), r.request(50, 10, index=0), r.request(50, 10, index=1)
    assert a.ids.shape == (60, 4, 6) and (a.ids == b.ids).all() and not (a.ids == c.ids).all()
    same = np.mean([(a.ids[t, l] == a.ids[t - 1, l]).all() for t in range(1, 60) for l in range(4)])
    assert 0.35 < same < 0.65  # temporal reuse 0.5
    hot = r.hot_order()
    assert r.global_weights.ravel()[hot[0]] == r.global_weights.max()


def steps_of(prompt, output, layers=2):
    """A trace where token t uses experts {t % 4, 4 + t % 4} at every layer."""
    ids = np.array([[[t % 4, 4 + t % 4]] * layers for t in range(prompt + output)], dtype=np.int16)
    return RequestTrace(prompt, output, ids=ids)


def test_serial_step_times_are_the_sum_of_their_parts():
    box = Box(layers=2, experts=8, top_k=2, slots=16, chips=4, floor=0.1, layer_sync=0.01, token_compute=0.001,
              prefill_chunk=4, page_cache=1e12)  # fmt: skip
    trace = steps_of(4, 3)
    m = Machine(box, BASELINE, np.arange(16), experts=8)
    r = m.run(trace)
    # prefill: one chunk of 4 tokens touches all 8 experts of both layers: 16 copies, cold page cache is warm
    assert r.prefill_misses == 16
    assert r.ttft == pytest.approx(0.1 + 2 * 0.01 + 4 * 0.001 + 16 * box.miss_time)
    # decode: two steps, every expert already resident
    assert r.tpots == pytest.approx([0.1 + 2 * 0.01] * 2)
    assert r.decode_misses == 0


def test_a_batched_decode_step_reads_the_union_of_its_sequences_experts_once():
    box = Box(layers=2, experts=8, top_k=2, slots=16, chips=4, floor=0.1, layer_sync=0.01, token_compute=0.001,
              prefill_chunk=4, page_cache=1e12)  # fmt: skip
    # the prompt touches all 8 experts; decode tokens t use {t % 4, 4 + t % 4}: two sequences share a step's experts
    same = Machine(box, BASELINE, np.arange(16), experts=8).run_streams([steps_of(4, 3), steps_of(4, 3)])
    assert same.tpots == pytest.approx([0.1 + 2 * 0.01] * 2)  # resident: the floor and the syncs, once per step
    assert same.decode_accesses == 2 * 2 * 2  # two steps, two layers, two distinct experts (not four)
    small = box.with_(slots=8)  # one layer of experts fits: a second sequence adds misses of its own
    other = RequestTrace(4, 3, ids=steps_of(6, 3).ids[2:])  # its tokens are two ahead: other experts
    one = Machine(small, BASELINE, np.arange(16), experts=8).run_streams([steps_of(4, 3)])
    two = Machine(small, BASELINE, np.arange(16), experts=8).run_streams([steps_of(4, 3), other])
    assert two.decode_accesses == 2 * one.decode_accesses and two.decode_misses > one.decode_misses
    assert max(two.tpots) > max(one.tpots)  # the misses' copies cost the step; still one floor for both tokens
    assert sum(two.tpots) < 2 * sum(one.tpots)


def test_concurrency_rows_on_the_reference_box(capsys):
    sim = Simulator(REFERENCE, REFERENCE_LOCALITY, prompts=1)
    rows = concurrency(sim, [WORKLOADS["chat"].scaled(0.1)], streams=(1, 4))
    one, four = rows
    assert four.aggregate_tok_s > 1.5 * one.aggregate_tok_s  # the floor and the resident weights are shared
    assert four.per_stream_tok_s < one.per_stream_tok_s  # the union of four tokens' experts costs copies
    assert one.experts_per_step < four.experts_per_step <= 4 * one.experts_per_step
    assert "| chat | 4 |" in concurrency_markdown(rows)


def test_a_verify_pass_reads_its_positions_experts_once_and_emits_the_stated_tokens():
    """Speculation in the model: each pass drafts (Box.draft_time) and verifies k + 1 positions as one batched step
    over their routing, then emits `accepted` + 1 tokens on average; every output token is emitted once."""
    box = Box(layers=2, experts=8, top_k=2, slots=16, chips=4, floor=0.1, layer_sync=0.01, token_compute=0.001,
              prefill_chunk=4, page_cache=1e12, draft_time=0.05)  # fmt: skip
    trace = steps_of(4, 9)  # 8 decode steps after the prompt's first token
    full = Machine(box, BASELINE, np.arange(16), experts=8).run_speculative(trace, 3, 3.0)
    assert len(full.tpots) == 8 and full.verifies == 2  # 4 tokens a pass
    assert full.tpots == pytest.approx([(0.05 + 0.1 + 2 * 0.01) / 4] * 8)  # resident: one floor for 4 positions
    none = Machine(box, BASELINE, np.arange(16), experts=8).run_speculative(trace, 3, 0.0)
    assert len(none.tpots) == 8 and none.verifies == 8  # a token a pass: the draft is pure cost
    half = Machine(box, BASELINE, np.arange(16), experts=8).run_speculative(trace, 3, 1.5)
    assert len(half.tpots) == 8 and half.verifies == 4  # 2.5 tokens a pass on average: 2, 3, 2, then the last
    plain = Machine(box, BASELINE, np.arange(16), experts=8).run(trace)
    assert np.mean(none.tpots) > np.mean(plain.tpots) > np.mean(full.tpots)


def test_speculation_rows_on_the_reference_box():
    """At the reference box's measured 1.2 drafts kept a pass speculation does not pay (what the box measured; the
    draft's cost is fitted to it), at 3 of 5 it does."""
    sim = Simulator(REFERENCE, REFERENCE_LOCALITY, prompts=1)
    ((plain, (low, high)),) = speculation(sim, [WORKLOADS["chat"].scaled(0.25)], ((5, 1.2), (5, 3.0)))
    assert low.decode_tok_s < plain.decode_tok_s < high.decode_tok_s
    assert low.experts_per_verify > 240  # six positions' union, more than one token's 40 x 6
    assert "| chat | 5 | 3 |" in speculation_markdown([(plain, [low, high])])
    with pytest.raises(ConfigError, match="K:A"):
        from dsflash.cli.simulate import _speculate

        _speculate("5:6")


def test_overlap_and_prefetch_never_slow_a_step_down():
    sim = Simulator(REFERENCE, REFERENCE_LOCALITY, prompts=1)
    wl = WORKLOADS["chat"].scaled(0.5)
    base = sim.run(BASELINE, wl)
    over = sim.run(Policy(overlap=True), wl)
    pre = sim.run(Policy(overlap=True, prefetch=True), wl)
    tm = sim.run(Policy(expert_major=False), wl)
    assert over.tpot < base.tpot and over.ttft <= base.ttft
    assert pre.tpot <= over.tpot * 1.02
    assert tm.ttft > 3 * base.ttft  # token by token, every prompt token pays a decode step


def test_calibration_short_rows():
    """chat and codegen within 25% of the box (the full table: DSFLASH_SLOW=1)."""
    sim = Simulator(REFERENCE, REFERENCE_LOCALITY, prompts=2)
    for name in ("chat", "codegen"):
        r, m = sim.run(BASELINE, WORKLOADS[name]), MEASURED[name]
        assert 0.75 < r.ttft / m.ttft < 1.25, (name, r.ttft)
        assert 0.75 < r.decode_tok_s / m.decode < 1.25, (name, r.decode_tok_s)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DSFLASH_SLOW"), reason="set DSFLASH_SLOW=1 (about 20 s)")
def test_calibration_full_table():
    sim = Simulator(REFERENCE, REFERENCE_LOCALITY, prompts=2)
    for name, wl in WORKLOADS.items():
        r, m = sim.run(BASELINE, wl), MEASURED[name]
        assert 0.75 < r.ttft / m.ttft < 1.25, (name, r.ttft)
        assert 0.75 < r.decode_tok_s / m.decode < 1.25, (name, r.decode_tok_s)


def write_trace(path):
    lines = [
        {"header": {"layers": [0, 1], "experts": 4, "top_k": 2}},
        {"kind": "prefill", "pos": 0, "n": 2, "layers": [[0, [0, 1], [1, 1]], [1, [2, 3], [1, 1]]]},
        {"event": "reset"},
        {"kind": "prefill", "pos": 0, "n": 3, "layers": [[0, [0, 1, 2], [2, 2, 2]], [1, [1, 3], [3, 3]]]},
        {"kind": "decode", "pos": 3, "n": 1, "layers": [[0, [0, 1], [1, 1]], [1, [2, 3], [1, 1]]]},
        {"kind": "decode", "pos": 4, "n": 1, "layers": [[0, [0, 2], [1, 1]], [1, [0, 3], [1, 1]]]},
        {"event": "reset"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_recorded_trace(tmp_path):
    path = tmp_path / "routing.jsonl"
    write_trace(path)
    reqs, header = load_recorded(path)
    assert header["experts"] == 4 and [(r.prompt_len, r.output_len) for r in reqs] == [(2, 1), (3, 3)]
    assert reqs[1].recorded[0].routing[1].tolist() == [1, 1, 1, 3, 3, 3]
    token_major = list(reqs[1].steps(chunk=128, expert_major=False))
    assert [s.n for s in token_major] == [1, 1, 1, 1, 1]
    sim = Simulator(REFERENCE.with_(slots=4), REFERENCE_LOCALITY, recorded=reqs, header=header)
    r = sim.run(BASELINE, None)
    assert r.ttft > 0 and r.tpot > 0 and 0 <= r.decode_hit <= 1
    (tmp_path / "bad.jsonl").write_text('{"kind": "decode"}\n')
    with pytest.raises(ConfigError, match="header"):
        load_recorded(tmp_path / "bad.jsonl")


def test_simulate_cli_on_a_recorded_trace(tmp_path):
    path = tmp_path / "routing.jsonl"
    write_trace(path)
    p = subprocess.run([sys.executable, "-m", "dsflash", "simulate", "--trace", str(path), "--slots", "4",
                        "--json", str(tmp_path / "o.json")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "| LFU replacement |" in p.stdout
    data = json.loads((tmp_path / "o.json").read_text())
    assert len(data["what_if"]) >= 8 and data["box"]["slots"] == 4


def test_prefix_reuse_makes_an_agent_turn_cost_its_new_tokens():
    from dsflash.sim.box import REFERENCE, REFERENCE_LOCALITY, WORKLOADS, Policy
    from dsflash.sim.run import Simulator

    sim = Simulator(REFERENCE, REFERENCE_LOCALITY, prompts=1)
    agent = WORKLOADS["agent"].scaled(0.125)  # 1024 tokens, 8 new ones a turn
    cold, warm = sim.run(Policy(), agent), sim.run(Policy(prefix_reuse=True), agent)
    assert warm.ttft < cold.ttft / 5
    chat = WORKLOADS["chat"].scaled(0.25)  # one prompt, no earlier turn: nothing to reuse
    assert sim.run(Policy(prefix_reuse=True), chat).ttft == sim.run(Policy(), chat).ttft
