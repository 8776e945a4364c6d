"""`dsflash ps`: the running servers, from the state directory, with a live health check."""

from __future__ import annotations


def add_parser(sub) -> None:
    from dsflash.cli._terminal import HelpFormatter

    p = sub.add_parser(
        "ps",
        help="list running servers",
        description="List the servers this user started (from the state directory) with their health.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--names", action="store_true", help="print model ids only (for `dsflash stop`)")
    p.add_argument("--json", action="store_true", help="one JSON object per server")
    p.set_defaults(run=run)


def run(args) -> int:
    import json
    import time
    from dataclasses import asdict

    from dsflash.server.registry import servers

    running = servers()
    if args.names:
        for r in running:
            print(r.model)
        return 0
    if args.json:
        for r in running:
            print(json.dumps({**asdict(r), "health": r.health(), "url": r.base_url + "/v1"}))
        return 0
    if not running:
        print("no running servers")
        return 0
    rows = [("MODEL", "PROFILE", "ENDPOINT", "PID", "HEALTH", "UPTIME")]
    for r in running:
        health = "stopping" if r.status == "stopping" else r.health()
        rows.append((r.model, r.profile, r.base_url + "/v1", str(r.pid), health, _uptime(time.time() - r.started)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _uptime(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
