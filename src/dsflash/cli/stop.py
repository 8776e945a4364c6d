"""`dsflash stop [MODEL]`: SIGTERM a running server and wait until it has exited and its port is free."""

from __future__ import annotations


def add_parser(sub) -> None:
    from dsflash.cli._terminal import HelpFormatter

    p = sub.add_parser(
        "stop",
        help="stop a running server (SIGTERM, then wait for its port to free)",
        description="Stop the server of MODEL (its id, an alias or its port). Without MODEL: the only running server; "
        "with several, name one or pass --all.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help="model id, alias or port")
    p.add_argument("--all", action="store_true", help="stop every running server")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait before SIGKILL")
    p.set_defaults(run=run)


def run(args) -> int:
    from dsflash.errors import DsflashError
    from dsflash.server.registry import servers

    running = servers()
    chosen = [r for r in running if args.all or r.matches(args.model)]
    if not chosen:
        what = f" for {args.model}" if args.model else ""
        print(f"no running server{what}")
        return 1 if args.model else 0
    if len(chosen) > 1 and not args.all:
        names = ", ".join(f"{r.model} (port {r.port})" for r in chosen)
        raise DsflashError(f"several servers match: {names}; name one by its port, or pass --all")
    code = 0
    for rec in chosen:
        code |= _stop(rec, args.timeout)
    return code


def _stop(rec, timeout: float) -> int:
    import contextlib
    import os
    import signal
    import time

    print(f"stopping {rec.model} (pid {rec.pid}, port {rec.port}) …", flush=True)
    try:
        os.kill(rec.pid, signal.SIGTERM)
    except ProcessLookupError:
        rec.remove()
        print("  already gone")
        return 0
    t0 = time.monotonic()
    killed = False
    while rec.alive() or _listening(rec.host, rec.port):
        if time.monotonic() - t0 > timeout and not killed:
            print(f"  still running after {timeout:.0f}s: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.pid, signal.SIGKILL)
            killed = True
        if time.monotonic() - t0 > timeout + 10:
            print(f"  port {rec.port} is still busy")
            return 1
        time.sleep(0.1)
    rec.remove()
    print(f"  stopped in {time.monotonic() - t0:.1f}s; port {rec.port} is free")
    return 1 if killed else 0


def _listening(host: str, port: int) -> bool:
    import socket

    host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
