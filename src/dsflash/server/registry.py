"""The registry of running servers: one record file per server, its log file, and a probe of its /health.

Running servers are found through files, not by scanning processes: each server writes
<servers_dir>/<port>.json (pid, host, port, model, profile, log, status) and removes it when it exits.
Light on purpose: `dsflash ps`, `stop` and `logs` read it and must not import torch.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from dsflash.paths import logs_dir, servers_dir


@dataclass
class ServerRecord:
    pid: int
    host: str
    port: int
    model: str
    profile: str
    context: int
    source: str
    aliases: list[str]
    log: str
    started: float
    status: str = "booting"  # booting | ready | stopping

    @property
    def path(self) -> Path:
        return servers_dir() / f"{self.port}.json"

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("[::1]" if self.host == "::" else self.host)
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"http://{host}:{self.port}"

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, self.path)  # readers never see half a file

    def remove(self) -> None:
        try:
            current = json.loads(self.path.read_text())
            if current.get("pid") == self.pid:  # a newer server may own this port's file by now
                self.path.unlink()
        except (OSError, ValueError):
            pass

    def matches(self, name: str | None) -> bool:
        return name is None or name in (self.model, self.source, str(self.port), *self.aliases)

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def health(self, timeout: float = 1.5) -> str:
        """ready | loading | unreachable (GET /health)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
        try:
            with opener.open(self.base_url + "/health", timeout=timeout) as r:
                return "ready" if r.status == 200 else "unknown"
        except urllib.error.HTTPError as e:
            return "loading" if e.code == 503 else "unknown"
        except (OSError, ValueError):
            return "unreachable"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours (e.g. a detached server we spawned and nobody reaped) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def servers(clean: bool = True) -> list[ServerRecord]:
    """Every server the registry knows, oldest first; files of dead processes are removed."""
    out = []
    for path in sorted(servers_dir().glob("*.json")):
        try:
            rec = ServerRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if not rec.alive():
            if clean:
                path.unlink(missing_ok=True)
            continue
        out.append(rec)
    return sorted(out, key=lambda r: r.started)


def new_log_path(slug: str, port: int) -> Path:
    """A new log file's path for a server of `slug` on `port` (the logs directory is made if missing)."""
    logs_dir().mkdir(parents=True, exist_ok=True)
    return logs_dir() / f"{slug}-{port}-{time.strftime('%Y%m%d-%H%M%S')}.log"
