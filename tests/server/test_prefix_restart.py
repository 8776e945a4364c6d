"""A real `dsflash serve` with --prefix-cache-dir, restarted: the first repeated conversation after the restart
reports cached prompt tokens through the `openai` client (usage.prompt_tokens_details.cached_tokens)."""

from __future__ import annotations

import openai

from tests.model.conftest import ROOT
from tests.server.conftest import start_server

MODEL = str(ROOT / "tiny_a" / "model")


def _chat(srv, messages):
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def test_a_restarted_server_reuses_the_snapshots_on_disk(tmp_path):
    snaps = tmp_path / "snaps"
    args = (MODEL, "--prefix-cache-dir", str(snaps), "--max-model-len", "1024", "--shutdown-grace", "1")
    convo = [{"role": "system", "content": "You answer briefly. " * 40}, {"role": "user", "content": "first?"}]
    srv = start_server(tmp_path, tmp_path / "cache", *args)
    try:
        srv.wait_ready()
        reply, cached = _chat(srv, convo)
        assert cached == 0  # a fresh directory: nothing to reuse yet
        _, again = _chat(srv, [*convo[:1], {"role": "user", "content": "second?"}])
        assert again > 0  # the shared system prompt's block boundary, from memory
    finally:
        assert srv.stop() == 0
    assert list(snaps.glob("*.snap"))

    srv = start_server(tmp_path, tmp_path / "cache", *args)
    try:
        srv.wait_ready()
        assert "snapshot(s) found in" in srv.wait_output("snapshot(s) found in")
        turn2 = [*convo, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
        _, cached = _chat(srv, turn2)
        assert cached > 0  # restored from the files the first server wrote
    finally:
        srv.stop()
