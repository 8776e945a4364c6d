"""`dsflash serve` / `stop` / `ps` / `logs` as a person uses them: first boot in a fresh cache, a second server on a
busy port (detached), stopping from another process while a request runs, the ports freed, exit codes 0."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.model.conftest import ROOT
from tests.server.conftest import TINY, dsflash_env, free_port, port_open, start_server


def dsflash(env, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsflash", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_boot_port_walk_detach_stop(tmp_path):
    cache = tmp_path / "fresh-cache"  # nothing generated yet: this is a first boot
    port = free_port()
    a = start_server(tmp_path, cache, "--shutdown-grace", "1", port=port)
    try:
        # the port opens at once; until the model is loaded every route but /metrics answers 503
        t0 = time.monotonic()
        while not port_open(a.port) and time.monotonic() - t0 < 30:
            a._find_port()
            time.sleep(0.02)
        port = a.port
        loading = httpx.get(a.base + "/health")
        assert loading.status_code == 503 and loading.json()["error"]["code"] == "not_ready"
        assert httpx.get(a.base + "/v1/models").status_code == 503
        assert httpx.get(a.base + "/openapi.json").status_code == 503  # it states the context and the vocabulary
        assert httpx.get(a.base + "/metrics").status_code == 200
        first_boot = a.wait_ready()
        assert first_boot < 60, f"first boot took {first_boot:.0f}s"
        out = a.wait_output("Ready in")
        assert "generated" in out and "Ready in" in out and f"http://127.0.0.1:{port}/v1" in out
        assert "expert store      built after the packer self-check" in out
        assert "limits    max_tokens 2,048 where a request names none (--max-tokens-default)" in out
        # port-qualified: once a second server of the model runs, `stop MODEL` refuses and `logs MODEL` is ambiguous
        assert f"dsflash stop {port}   (or Ctrl-C)" in out and f"dsflash logs {port} --follow" in out
        for label in ("checkpoint", "inventory", "expert store", "dense weights", "slots and caches", "warm-up", "API"):
            assert f" {label} " in out, label

        # a second server asks for the same port: it walks up, says so, and reuses the generated model; its key,
        # given as a flag, is never shown (nor suggested as an unset environment variable) on its card
        env = a.env
        t0 = time.monotonic()
        chat_kwargs = '{"thinking": false}'
        b = dsflash(
            env, "serve", TINY, "--port", str(port), "--detach", "--default-chat-template-kwargs", chat_kwargs,
            "--api-key", "flag-key-123",
        )  # fmt: skip
        assert b.returncode == 0, b.stdout + b.stderr
        assert time.monotonic() - t0 < 60
        assert f"{port} is busy; using" in b.stdout and "Ready in" in b.stdout
        assert "checkpoint        reused" in b.stdout and "expert store      reused" in b.stdout
        assert 'curl -H "Authorization: Bearer <the key given with --api-key>" ' in b.stdout
        assert "$DSFLASH_API_KEY" not in b.stdout and "flag-key-123" not in b.stdout
        ps = [json.loads(line) for line in dsflash(env, "ps", "--json").stdout.splitlines()]
        assert len(ps) == 2 and port in [r["port"] for r in ps] and all(r["health"] == "ready" for r in ps)
        port_b = next(r["port"] for r in ps if r["port"] != port)
        # the server-wide default (thinking off) applies; a request can still turn thinking on
        body, key = {"messages": [{"role": "user", "content": "x"}]}, {"Authorization": "Bearer flag-key-123"}
        assert httpx.post(f"http://127.0.0.1:{port_b}/tokenize", json=body).status_code == 401
        tok = httpx.post(f"http://127.0.0.1:{port_b}/tokenize", json=body, headers=key)
        assert tok.json()["tokens"][-1] == 128822

        # name ambiguity: two servers of the same model need a port or --all
        for name in ([], ["dsflash-tiny-v4.1"]):
            amb = dsflash(env, "stop", *name)
            assert amb.returncode == 1 and "several servers match" in amb.stderr
            amb = dsflash(env, "logs", *name)  # never one of them picked silently
            assert amb.returncode == 1 and "several servers match" in amb.stderr
        assert f"dsflash stop {port_b}\n" in b.stdout  # a detached server's card: no Ctrl-C

        # stop A from another process while a request is streaming on it: the stream ends cleanly, exit 0
        got = {}

        def stream():
            body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", a.base + "/v1/completions", json=body, timeout=60) as r:
                got["lines"] = [line for line in r.iter_lines() if line]

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)
        stop = dsflash(env, "stop", str(port))
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert a.proc.wait(30) == 0
        t.join(30)
        assert not port_open(port)
        lines = got["lines"]
        assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]  # cancelled after the grace period, told so
        assert "stopped" in a.output()

        logs = dsflash(env, "logs", str(port_b))
        assert logs.returncode == 0 and "Ready in" in logs.stdout
        gone = dsflash(env, "logs", str(port))  # a stopped server's log, by the port its card named
        assert gone.returncode == 0 and f"stopped dsflash-tiny-v4.1 on port {port}" in gone.stdout
        last = dsflash(env, "stop")  # only one left: no name needed
        assert last.returncode == 0 and "is free" in last.stdout
        assert not port_open(port_b)
        assert dsflash(env, "ps").stdout.strip() == "no running servers"
    finally:
        a.stop()
        dsflash(a.env, "stop", "--all")


def test_a_context_beyond_the_models_positions_is_one_clear_line(tmp_path, model_cache):
    """vLLM's rule: --max-model-len past max_position_embeddings (the embedded model's is 65536) is an error unless
    explicitly allowed."""
    env = dsflash_env(tmp_path / "state", model_cache)
    r = dsflash(env, "serve", "--port", str(free_port()), "--max-model-len", "70000", timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    err = [line for line in r.stderr.splitlines() if line]
    assert err == ["dsflash serve: error: --max-model-len 70000 is beyond this model's max_position_embeddings "
                   "(65536); lower it, or pass --allow-long-context to serve it anyway"]  # fmt: skip


def test_boot_failure_is_one_clear_line(tmp_path):
    env = dsflash_env(tmp_path / "state", tmp_path / "cache")
    r = dsflash(env, "serve", "some-org/not-cached@main", "--port", str(free_port()), timeout=60)
    assert r.returncode == 1
    assert "not in the Hugging Face cache" in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr
    r = dsflash(env, "serve", "./no/such/dir", timeout=30)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    r = dsflash(env, "profiles", "rothgar/deepseek-v4.1-flash-p300x2")
    assert "p300x2-32k" in r.stdout and "33792" in r.stdout
    r = dsflash(env, "serve", "rothgar/deepseek-v4.1-flash-p300x2", "--profile", "nope", timeout=30)
    assert r.returncode == 1 and "p300x2-32k" in r.stderr


def test_stores_under_xdg_cache_home_and_another_revisions_store_refused_until_rebuild(tmp_path):
    """With XDG_CACHE_HOME set (and no DSFLASH_CACHE), `dsflash store build` writes the stores where `dsflash serve`
    looks for them, and nothing goes under $HOME/.cache. A model's store built from another revision of the model is
    never used: serve refuses with the fix in one line, naming the store that build wrote, and with --rebuild
    replaces it (the boot row says why). The model's store for another TP degree is its own, and stays as it was
    through all of it. (One test: each half needs a built store and a server boot.)"""
    model = tmp_path / "model"
    shutil.copytree(ROOT / "tiny_a" / "model", model)
    home, xdg = tmp_path / "home", tmp_path / "xdg"
    home.mkdir()
    env = dsflash_env(tmp_path / "state", tmp_path / "unused")
    env.pop("DSFLASH_CACHE")
    env.pop("DSFLASH_KERNELS")  # this test is the one that builds them where the cache is
    env.update(HOME=str(home), XDG_CACHE_HOME=str(xdg))
    stores = []
    for tp in ("2", "1"):
        r = dsflash(env, "store", "build", str(model), "--tp", tp, "--no-progress")
        assert r.returncode == 0, r.stderr
        stores.append(Path(json.loads(r.stdout)["store"]))
    assert all(s.is_relative_to(xdg / "dsflash") for s in stores), stores
    assert stores[0].name == "weights" and stores[1].name == "weights-tp1-bfp8_b"
    before = {p.name: p.stat().st_mtime_ns for p in stores[0].iterdir()}
    config = model / "config.json"
    config.write_text(config.read_text() + "\n")  # another revision: the same model, other bytes
    r = dsflash(env, "serve", str(model), "--port", str(free_port()), timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and str(stores[1]) in err[0] and "revision" in err[0] and "--rebuild" in err[0], err
    srv = start_server(tmp_path, tmp_path / "unused", str(model), "--rebuild", env=env)
    try:
        srv.wait_ready()
        out = srv.wait_output("Ready in")
        assert "rebuilt (built for revision" in out and "TP 1" in out
    finally:
        srv.stop()
    assert {p.name: p.stat().st_mtime_ns for p in stores[0].iterdir()} == before
    assert not (home / ".cache").exists(), sorted(p for p in home.rglob("*"))
    assert (xdg / "dsflash" / "kernels").is_dir() or not shutil.which("cc")  # the kernels follow the cache too
