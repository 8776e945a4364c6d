"""`dsflash bench` black-box against a real embedded-model server (the session's open server, recording routing),
and `dsflash simulate` on the routing that server recorded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.conftest import free_port


@pytest.fixture(scope="module")
def served(open_server):
    return open_server


def bench(srv, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dsflash", "bench", "--base-url", srv.base, *args],
                          capture_output=True, text=True, timeout=timeout, env=srv.env)  # fmt: skip


def test_completions_run_writes_vllm_json_and_png(served, tmp_path):
    srv, _ = served
    out = tmp_path / "chat.json"
    p = bench(srv, "--workload", "chat", "--scale", "0.25", "--num-prompts", "3", "--save-result", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "============ Serving Benchmark Result ============" in p.stdout
    data = json.loads(out.read_text())
    assert data["completed"] == 3 and data["failed"] == 0 and data["num_prompts"] == 3
    assert data["model_id"] == "dsflash-tiny-v4.1" and data["backend"] == "openai"
    assert data["workload"] == "chat" and data["max_concurrency"] == 1 and data["request_rate"] == "inf"
    # --ignore-eos (forced for the random dataset): exactly the requested tokens; the server adds BOS to the 31
    assert data["total_output_tokens"] == 3 * 64
    assert data["total_input_tokens"] == 3 * 32
    assert data["mean_ttft_ms"] > 0 and data["mean_tpot_ms"] > 0 and data["p99_itl_ms"] > 0
    assert data["mean_e2el_ms"] > data["mean_ttft_ms"]
    assert data["decode_tok_s"] == pytest.approx(1000 / data["mean_tpot_ms"])
    assert data["max_concurrent_requests"] == 1
    # the timed requests' share of the server's expert counters, under the engine's own names (dsflash.counters)
    experts = data["experts"]
    assert experts["hits"] + experts["misses"] > 0 and {"bytes_streamed", "hit_rate"} <= set(experts)
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_chat_endpoint_detailed(served, tmp_path):
    srv, _ = served
    p = bench(srv, "--endpoint", "chat", "--random-input-len", "40", "--random-output-len", "12", "--num-prompts",
              "2", "--max-concurrency", "1", "--save-detailed", "--result-dir", str(tmp_path), "--no-plot",
              "--ready-check-timeout-sec", "0")  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    (path,) = tmp_path.glob("openai-chat-infqps-concurrency1-dsflash-tiny-v4.1-*.json")
    data = json.loads(path.read_text())
    assert data["backend"] == "openai-chat" and data["output_lens"] == [12, 12]
    assert all(i > 40 for i in data["input_lens"])  # the chat template adds tokens
    assert len(data["itls"][0]) >= 11 and not list(tmp_path.glob("*.png"))


def test_errors_are_one_line(served):
    srv, _ = served
    p = bench(srv, "--workload", "long", "--num-prompts", "1")
    assert p.returncode == 1 and "p300x2-32k" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "dsflash", "bench", "--port", str(free_port())], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 1 and "cannot reach" in p.stderr and "Traceback" not in p.stderr


def test_recorded_routing_replays_in_the_simulator(served, tmp_path):
    srv, routing = served
    assert bench(srv, "--workload", "chat", "--scale", "0.05", "--num-prompts", "1").returncode == 0
    header = json.loads(routing.read_text().splitlines()[0])["header"]
    assert header == {"layers": list(range(8)), "experts": 8, "top_k": 2}
    p = subprocess.run([sys.executable, "-m", "dsflash", "simulate", "--trace", str(routing), "--slots", "16"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "| reference box" in p.stdout and "8 experts" in p.stderr


def test_multi_turn_reports_ttft_by_turn(served, tmp_path):
    srv, _ = served
    out = tmp_path / "turns.json"
    p = bench(srv, "--workload", "multi-turn", "--scale", "0.05", "--save-detailed", "--save-result", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert data["workload"] == "multi-turn" and data["turns"] == 4 and data["turn_len"] == 3
    assert data["completed"] == 8 and data["turn_indices"] == [0, 1, 2, 3] * 2
    assert len(data["mean_ttft_ms_by_turn"]) == 4 and all(t > 0 for t in data["mean_ttft_ms_by_turn"])
    lens = data["input_lens"]  # each turn resends the conversation: its prompt grows by the reply + 3 tokens
    assert all(lens[i + 1] > lens[i] for i in (0, 1, 2, 4, 5, 6)) and lens[4] < lens[3]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
