"""Sockets and uvicorn: bind the first free port from the one asked for, run the app, shut down on SIGTERM/SIGINT."""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
from collections.abc import Callable

import uvicorn

from dsflash.errors import DsflashError

PORT_WALK = 100


class PortError(DsflashError):
    """No port could be bound."""


def bind(host: str, port: int, walk: int = PORT_WALK) -> socket.socket:
    """A listening socket on host:port, or on the next free port above it (the socket is ours: no race)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    last = None
    for p in range(port, min(port + walk, 65536)):
        # IPPROTO_TCP spelled out: asyncio disables Nagle only on sockets whose proto says TCP, and with Nagle on
        # every response's second write waits for the client's delayed ACK (40 ms a request on Linux)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by the accepted sockets
        # reuse a port whose old connections linger in TIME_WAIT; Linux still refuses it while anyone listens on it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, p))
            sock.listen(2048)
            sock.set_inheritable(True)
            return sock
        except OSError as e:
            sock.close()
            last = e
            if e.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise PortError(f"cannot listen on {host}:{p}: {e.strerror}") from None
    raise PortError(f"no free port in {port}..{port + walk - 1} on {host} ({last})")


class _Server(uvicorn.Server):
    """uvicorn, except that a signal starts our drain and is not re-raised after shutdown (so we exit 0)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]):
        super().__init__(config)
        self.on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        old = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def handle_exit(self, sig, frame) -> None:
        self.on_signal()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        self.should_exit = True


def make_server(app, on_signal: Callable[[], None], grace: float) -> _Server:
    """A uvicorn server for app; run it with .run(sockets=[sock]) on the main thread (it owns SIGINT/SIGTERM)."""
    config = uvicorn.Config(
        app,
        http="h11",
        lifespan="off",
        log_level="warning",
        access_log=False,
        # backstop only: the app cancels the running request after its own grace period
        timeout_graceful_shutdown=int(grace) + 5,
        timeout_keep_alive=5,
    )
    return _Server(config, on_signal)


def stop(server: _Server) -> None:
    """Ask a running server to shut down (from another thread, e.g. when boot failed)."""
    server.should_exit = True
