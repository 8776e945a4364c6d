"""The engine (slot LRU over the bfp store, tensor-parallel ranks over gloo) against the CPU reference."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dsflash.errors import ConfigError
from dsflash.formats import bfp
from dsflash.gates.compare import compare_logits
from dsflash.gates.reference import reference_forward, runner_forward
from dsflash.gates.run import Scores, _score, engine_scores, gate_ids, reference_scores, report
from dsflash.model.experts import ResidentExperts
from dsflash.runtime.cpu.dense import HEAD_EXACT
from dsflash.runtime.reference.loader import LoadedModel, load_reference
from dsflash.runtime.spec import EngineSpec
from dsflash.runtime.tp.launch import start_engine
from dsflash.service.files import open_dir
from dsflash.store.build import build_store
from tests.model.conftest import ROOT
from tests.runtime.conftest import GATE_TOKENS, bfp8_at_every_tp, gate_spec


def _tp_degrees(files):
    return [d for d in (1, 2, 4) if files.ckpt.config.num_attention_heads % d == 0]


def test_bfp8_engine_is_the_reference_at_tp1_and_tp2_with_evictions(setup, cache):
    """bfp8 holds the FP4 experts exactly: at TP 1 and 2 and with as few slots as a token activates, the gates
    pass, logits agree to float32 noise and the LRU really evicts. (TP 4: the gates CLI test runs it with bfp8 and
    the screened-head test checks it equals TP 1.)"""
    files, want = setup[0], setup[3]
    n_active, seen = files.ckpt.config.num_experts_per_tok, []
    for tp, got in bfp8_at_every_tp(setup, cache, degrees=(1, 2), prefill_matmul="fp32"):
        seen.append(tp)
        r = report(want, got)
        assert r["pass"], (tp, r)
        assert r["experts"]["misses"] > 0 and r["experts"]["slots"] == n_active
        for part in ("prefill", "decode"):
            diff = compare_logits(getattr(want, part), getattr(got, part))
            assert diff["max_abs"] < 1e-3, (tp, part, diff)
    assert seen == [1, 2]


def test_bfp4_engine_adds_nothing_beyond_the_format(setup, cache):
    """With bfp4 the engine equals the reference fed the same bfp4-rounded experts; bfp8 is strictly better."""
    files, ids, prefill, want = setup
    got = engine_scores(
        files,
        ids,
        prefill,
        gate_spec(
            tp=1, expert_slots=3, expert_format="bfp4_b", cache_dir=cache, prefill_matmul="fp32", rebuild_store=True
        ),
    )
    ref = load_reference(files.ckpt, files.token_map, qat=False, dspark=False)
    rounded = {k: tuple(_bfp4(w) for w in ws) for k, ws in ref.experts.weights.items()}
    ideal = LoadedModel(ref.cfg, ref.model, ResidentExperts(rounded, ref.cfg.swiglu_limit))
    best = Scores(*_score(reference_forward(ideal, len(ids)), ids, prefill))
    for part in ("prefill", "decode"):
        assert compare_logits(getattr(best, part), getattr(got, part))["max_abs"] < 1e-3
    r4 = report(want, got)
    r8 = report(
        want,
        engine_scores(
            files, ids, prefill, gate_spec(expert_slots=3, expert_format="bfp8_b", cache_dir=cache, rebuild_store=True)
        ),
    )
    for part in ("prefill", "decode"):
        assert r8[part]["mean_kl"] < r4[part]["mean_kl"] <= 0.035
        assert r8[part]["decisive_top1"] >= r4[part]["decisive_top1"]


def _bfp4(w: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(bfp.unpack(bfp.pack(w.float().numpy(), "bfp4_b", search=True), "bfp4_b", tuple(w.shape)))


def test_screened_head_is_tp_invariant_and_exact_where_it_counts(cache):
    """The default formats (bfp4_b experts, FP8 dense) with the head's FP8 screen for decode forced on (the tiny
    heads are below its size threshold): TP 4 equals TP 1 to float32 noise (the screened set is chosen on the
    gathered logits), each decode position's highest logits are the bf16 head's bits, the screened tail stays within
    FP8 rounding, and the divergence from the reference stays bfp4_b's own."""
    files = open_dir(ROOT / "tiny_a" / "model")
    ids, prefill = gate_ids(files, 90)
    want = reference_scores(files, ids, prefill)
    for tp in (1, 4):
        build_store(files.ckpt, cache, tp=tp, fmt="bfp4_b", progress=False, rebuild=True)

    def scores(tp: int, screen: bool) -> Scores:
        spec = gate_spec(tp=tp, expert_slots=4, expert_format="bfp4_b", cache_dir=cache, screen_head=screen)
        runner = start_engine(files.ckpt, files.token_map, len(ids), spec)
        try:
            return Scores(*_score(runner_forward(runner), ids, prefill), runner.counters(), 4)
        finally:
            runner.close()

    plain, one, four = scores(1, False), scores(1, True), scores(4, True)
    assert compare_logits(one.prefill, four.prefill)["max_abs"] < 1e-4
    assert compare_logits(one.decode, four.decode)["max_abs"] < 1e-4
    assert np.array_equal(one.prefill, plain.prefill)  # prefill multiplies the bf16 head
    top = np.argsort(-one.decode, axis=-1)[:, : HEAD_EXACT // 2]
    assert np.array_equal(np.take_along_axis(one.decode, top, -1), np.take_along_axis(plain.decode, top, -1))
    tail = np.abs(one.decode - plain.decode)
    assert 0 < tail.max() < 0.05 * np.abs(plain.decode).max()
    r = report(want, four)
    for part in ("prefill", "decode"):  # bfp4_b's own cost (test_bfp4_engine_adds_nothing_beyond_the_format)
        assert r[part]["mean_kl"] <= 0.035, r


def test_greedy_generation_follows_the_reference_where_decisive(cache):
    """64 greedy tokens: wherever the reference's own greedy choice was decisive, the engine picks it too."""
    files = open_dir(ROOT / "tiny_b" / "model")
    prompt = gate_ids(files, 40)[0]
    ref = load_reference(files.ckpt, files.token_map, qat=False, dspark=False)
    fwd = reference_forward(ref, len(prompt) + 64)
    seq, margins = list(prompt), []
    logits = fwd(torch.tensor([seq]), 0, True)[0, -1]
    for _ in range(64):
        top2 = logits.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        seq.append(int(logits.argmax()))
        logits = fwd(torch.tensor([seq[-1:]]), len(seq) - 1, False)[0, -1]
    build_store(files.ckpt, cache, tp=2, fmt="bfp8_b", progress=False, rebuild=True)
    spec = gate_spec(tp=2, expert_slots=3, expert_format="bfp8_b", cache_dir=cache)
    runner = start_engine(files.ckpt, files.token_map, len(seq) + 1, spec)
    try:
        runner.reset()
        out = [int(runner.forward(seq[: len(prompt)], 0, False)[-1].argmax())]
        for pos in range(len(prompt), len(seq) - 1):
            out.append(int(runner.forward([seq[pos]], pos, False)[-1].argmax()))
    finally:
        runner.close()
    want = seq[len(prompt) :]
    decisive = np.array(margins) >= 0.10
    assert decisive.sum() > 30
    assert all(o == w for o, w, d in zip(out, want, decisive, strict=True) if d)


def test_tp_degree_must_divide_the_heads(cache):
    files = open_dir(ROOT / "tiny_b" / "model")  # 6 heads
    with pytest.raises(ConfigError, match="does not divide this model's 6 attention heads"):
        start_engine(files.ckpt, files.token_map, 16, EngineSpec(tp=4, cache_dir=cache))


def test_gates_cli_passes_at_its_defaults_with_evictions(cache, capsys):
    """`dsflash gates` as a user runs it: the default format (auto: bfp8_b, the tiny store fits) at the highest TP
    degree the heads allow (tiny_a: 4) and as few slots as a token activates."""
    from dsflash.cli.main import main

    files = open_dir(ROOT / "tiny_a" / "model")
    cfg = files.ckpt.config
    tp = max(_tp_degrees(files))
    args = ["--tp", str(tp), "--expert-slots", str(cfg.num_experts_per_tok), "--tokens", str(GATE_TOKENS)]
    code = main(["gates", str(files.path), *args, "--cache-dir", cache, "--rebuild"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["pass"], r
    assert r["config"]["expert_format"] == "bfp8_b" and r["config"]["tp"] == tp
    assert r["experts"]["misses"] > 0 and r["experts"]["slots"] == cfg.num_experts_per_tok
    assert r["loss"]["engine"] == pytest.approx(r["loss"]["reference"], abs=1e-3) and r["loss"]["reference"] > 0


def test_next_token_loss_scores_the_token_that_follows():
    from dsflash.gates.compare import next_token_loss

    logits = np.full((3, 4), -30.0)
    logits[0, 2] = logits[1, 3] = 0.0  # row i predicts ids[i + 1]
    assert next_token_loss(logits, [0, 2, 3]) == pytest.approx(0.0, abs=1e-9)
    assert next_token_loss(logits, [0, 3, 2]) > 20


def test_gates_on_the_demo_score_its_held_out_conversations(tmp_path, capsys):
    """`--text held-out`: the demo model's generated conversations from value pools it never trained on are what is
    scored (over these first 192 tokens, a sum's and a repeat's conversations, its loss is more than a nat below
    the mixed text's), and the engine's loss is the reference's."""
    import dsflash
    from dsflash.cli.main import main

    demo = str(Path(dsflash.__file__).parent / "data" / "demo-v4.1")
    losses = {}
    for text in ("held-out", "mixed"):
        code = main(["gates", demo, "--text", text, "--tokens", "192", "--cache-dir", str(tmp_path)])
        r = json.loads(capsys.readouterr().out)
        assert code == 0 and r["pass"], r
        assert r["loss"]["engine"] == pytest.approx(r["loss"]["reference"], abs=1e-2)
        losses[text] = r["loss"]["reference"]
    assert losses["held-out"] < losses["mixed"] - 1, losses
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe")
    assert main(["gates", demo, "--text", str(bad), "--cache-dir", str(tmp_path)]) == 1
    assert "not a readable UTF-8 file" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gates_refuse_a_missing_gpu_before_scoring(monkeypatch, capsys):
    from dsflash.cli.main import main
    from dsflash.gates import run

    def never(*args, **kwargs):
        raise AssertionError("the reference ran before the device was checked")

    monkeypatch.setattr(run, "reference_scores", never)
    assert main(["gates", str(ROOT / "tiny_a" / "model"), "--device", "cuda"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dsflash gates: error: --device cuda: this torch build sees no CUDA GPU"]


def test_gates_at_another_tp_build_their_own_store_and_keep_the_first(tmp_path, monkeypatch, capsys):
    """The stores gates use are the ones `dsflash serve` reads: at another TP degree than the model's store, gates
    build that degree's store beside it (once) and leave the first one as it was."""
    from dsflash.cli.main import main
    from dsflash.gates import run
    from dsflash.store.layout import StoreManifest, store_dir

    files = open_dir(ROOT / "tiny_a" / "model")
    build_store(files.ckpt, tmp_path, tp=1, fmt="bfp8_b", progress=False)
    weights = store_dir(files.path, tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in weights.iterdir()}

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(run, "gate_ids", stop)  # the scoring that follows the store
    args = ["gates", str(files.path), "--tp", "2", "--expert-format", "bfp8_b", "--cache-dir", str(tmp_path)]
    with pytest.raises(Stop):
        main(args)
    beside = store_dir(files.path, tmp_path, 2, "bfp8_b")
    assert beside != weights and StoreManifest.read(beside).geometry.tp == 2
    built = {p.name: p.stat().st_mtime_ns for p in beside.iterdir()}
    with pytest.raises(Stop):
        main(args)
    assert {p.name: p.stat().st_mtime_ns for p in beside.iterdir()} == built  # found again, not rebuilt
    assert {p.name: p.stat().st_mtime_ns for p in weights.iterdir()} == before
    assert StoreManifest.read(weights).geometry.tp == 1


def test_a_failed_step_on_either_rank_fails_that_request_alone(cache):
    """An allocation that fails on rank 1 (its address space capped at what it holds) and one that fails on rank 0
    while rank 1 waits in a collective: each time that request gets OutOfMemory, the ranks rejoin, and the next
    request gives what it gave before."""
    import resource

    from dsflash.errors import OutOfMemory
    from dsflash.runtime.scheduler.engine import Engine
    from dsflash.runtime.scheduler.queue import GenerationRequest
    from dsflash.runtime.scheduler.sampler import SamplingParams

    files = open_dir(ROOT / "tiny_a" / "model")
    runner = start_engine(files.ckpt, files.token_map, 2048, gate_spec(tp=2, cache_dir=cache))
    engine = Engine(runner, eos_ids={1}).start()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    short, long = tuple(range(5, 45)), tuple(5 + i % 500 for i in range(1500))

    def run(prompt):
        return [e.token for e in engine.submit(GenerationRequest(prompt, params)) if e.token is not None]

    try:
        want = run(short)
        rank1 = runner.procs[0].pid
        _, hard = resource.prlimit(rank1, resource.RLIMIT_AS)
        status = Path(f"/proc/{rank1}/status").read_text().splitlines()
        held = int(next(ln for ln in status if ln.startswith("VmSize")).split()[1]) * 1024
        resource.prlimit(rank1, resource.RLIMIT_AS, (held, hard))
        try:
            with pytest.raises(OutOfMemory):
                run(long)
        finally:
            resource.prlimit(rank1, resource.RLIMIT_AS, (hard, hard))
        assert run(short) == want

        forward = runner.rank0.forward

        def short_of_memory(tokens, start_pos, last_only=False, verify=False):
            if tokens.shape[1] > 100:  # after the header: rank 1 is in the forward, waiting for rank 0
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
            return forward(tokens, start_pos, last_only, verify)

        runner.rank0.forward = short_of_memory
        with pytest.raises(OutOfMemory):
            run(long)
        assert run(short) == want and engine.alive and all(p.is_alive() for p in runner.procs)
    finally:
        engine.close()
        runner.close()
