"""One server process, composed: bind the port, answer (503) while the model boots on a thread, attach the booted
service, serve until a signal, then close everything. Its registry record follows along (booting -> ready ->
stopping -> removed).

The front end (cli/serve.py) only shows what happens: it gets the boot's rows, the answer of the first GET /health
and a failed boot's error through the callbacks of `run`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

from dsflash.server import http
from dsflash.server.app import App
from dsflash.server.registry import ServerRecord
from dsflash.service.boot import Booted, BootOptions, Report, boot, make_backend
from dsflash.service.catalog import ModelChoice
from dsflash.service.generator import Generator
from dsflash.text.chat import ChatOptions

# (what boot produced, the first GET /health's answer, its seconds)
Ready = Callable[[Booted, str, float], None]


class Serving:
    """Built before anything starts (a flag the backend cannot honour fails here, then the port is bound: `port` is
    the one really listened on); `run()` does the rest on the calling (main) thread."""

    def __init__(
        self,
        choice: ModelChoice,
        opts: BootOptions,
        host: str = "127.0.0.1",
        port: int = 20000,
        api_key: str | None = None,
        shutdown_grace: float = 5.0,
        chat_defaults: ChatOptions | None = None,
        allowed_origins: tuple[str, ...] = (),
    ):
        self.choice, self.opts, self.host, self.grace = choice, opts, host, shutdown_grace
        self.backend = make_backend(opts)
        self.sock = http.bind(host, port)
        self.port: int = self.sock.getsockname()[1]
        self.max_len = opts.max_model_len or choice.profile.context
        self.app = App(
            choice.model_id,
            choice.aliases,
            choice.source,
            chat_defaults,
            api_key,
            shutdown_grace=shutdown_grace,
            allowed_origins=allowed_origins,
            revision=_revision(choice.source),
        )
        self.booted: Booted | None = None
        self.record: ServerRecord | None = None
        self.exit_code = 0

    def run(self, log: str, report: Report, ready: Ready, failed: Callable[[BaseException], None]) -> int:
        """Serve until stopped; 0, or 1 when the boot failed. `log` is the server's log file (for the registry)."""
        c = self.choice
        self.record = ServerRecord(
            os.getpid(), self.host, self.port, c.model_id, c.profile.name, self.max_len, c.source, list(c.aliases),
            log, time.time(),
        )  # fmt: skip
        self.record.save()
        self.server = http.make_server(self.app, self._on_signal, self.grace)
        threading.Thread(target=self._boot, args=(report, ready, failed), name="dsflash-boot", daemon=True).start()
        try:
            self.server.run(sockets=[self.sock])
        finally:
            if self.booted is not None:
                self.booted.close()
            self.record.remove()
        return self.exit_code

    def _on_signal(self) -> None:
        if self.app.state != "draining":
            self.record.status = "stopping"
            self.record.save()
        self.app.drain()

    def _boot(self, report: Report, ready: Ready, failed: Callable[[BaseException], None]) -> None:
        try:
            booted = boot(self.choice, self.opts, report, self.backend)
        except Exception as e:
            failed(e)
            with contextlib.suppress(Exception):
                self.backend.close()
            self.exit_code = 1
            self.app.fail()
            http.stop(self.server)
            return
        self.booted = booted
        self.app.attach(Generator.serving(booted))
        if self.app.state != "ready":  # a signal came during boot
            return
        t = time.perf_counter()
        health = self.record.health(timeout=10)
        ready(booted, health, time.perf_counter() - t)
        self.record.status = "ready"
        self.record.save()


def _revision(source: str) -> str | None:
    """The pinned revision of a Hub source (repo@rev); None for a directory, the embedded model or an unpinned id."""
    _, at, rev = source.partition("@")
    return rev if at else None
