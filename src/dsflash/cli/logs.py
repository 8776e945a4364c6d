"""`dsflash logs [MODEL] [--follow]`: a server's log (boot rows and one line per request)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from dsflash.cli._terminal import HelpFormatter

    p = sub.add_parser(
        "logs",
        help="print a server's log",
        description="Print the log of the running server of MODEL (or of the only one running); with no running "
        "server, the newest log of MODEL. --follow keeps printing until the server exits.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help="model id, alias or port")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the server exits")
    p.set_defaults(run=run)


def run(args) -> int:
    import sys
    import time
    from pathlib import Path

    from dsflash.errors import DsflashError
    from dsflash.paths import logs_dir
    from dsflash.server.registry import pid_alive, servers

    running = [r for r in servers() if r.matches(args.model)]
    if len(running) > 1:  # never pick one silently
        names = ", ".join(f"{r.model} (port {r.port})" for r in running)
        raise DsflashError(f"several servers match: {names}; name one by its port")
    if running:
        path, pid = Path(running[-1].log), running[-1].pid
    else:
        path, pid = _newest_log(logs_dir(), args.model), None
        if path is None:
            raise DsflashError(f"no log{' for ' + args.model if args.model else ''} in {logs_dir()}")
    pos = 0
    try:
        while True:
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
            pos += len(data)
            sys.stdout.write(data.decode("utf-8", errors="replace"))
            sys.stdout.flush()
            if not args.follow or pid is None or not pid_alive(pid):
                return 0
            time.sleep(0.3)
    except KeyboardInterrupt:
        return 0


def _newest_log(folder, model):
    """The newest log of a model (its id or alias), or of a port (a log is named <model>-<port>-<time>.log)."""
    import re

    if model and model.isdigit():
        pattern = f"*-{int(model)}-*.log"
    else:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "--", model).strip("-") if model else ""
        pattern = f"{slug}*.log" if slug else "*.log"
    logs = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None
