"""Shared by serve / stop / ps / logs: the state directory of running servers, their logs, and the terminal rows.

Running servers are found through files, not by scanning processes: each server writes
<state>/servers/<port>.json (pid, host, port, model, profile, log, status) and removes it when it exits.
Light on purpose: `dsflash ps` must not import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where the help already says what an unset flag means."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "(default" in text:
            return text
        return super()._get_help_string(action)


def state_root() -> Path:
    """$DSFLASH_STATE, else $XDG_STATE_HOME/dsflash, else ~/.local/state/dsflash."""
    if os.environ.get("DSFLASH_STATE"):
        return Path(os.environ["DSFLASH_STATE"]).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME") or "~/.local/state"
    return Path(xdg).expanduser() / "dsflash"


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
        return state_root() / "servers" / f"{self.port}.json"

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
    """Every server the state directory knows, oldest first; files of dead processes are removed."""
    out = []
    for path in sorted((state_root() / "servers").glob("*.json")):
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


def log_dir() -> Path:
    return state_root() / "logs"


def new_log_path(slug: str, port: int) -> Path:
    log_dir().mkdir(parents=True, exist_ok=True)
    return log_dir() / f"{slug}-{port}-{time.strftime('%Y%m%d-%H%M%S')}.log"


class Console:
    """Lines for a person: to the terminal (unless detached) and to the server's log file."""

    def __init__(self, to_stdout: bool = True, log_path: Path | None = None):
        self.to_stdout = to_stdout
        self.tty = to_stdout and sys.stdout.isatty()
        self.file = open(log_path, "a", encoding="utf-8", buffering=1) if log_path else None  # noqa: SIM115
        self._pending = False

    def line(self, text: str, stream=None) -> None:
        """A line for the terminal (stdout, or `stream`: errors go to stderr) and the log file."""
        if self.to_stdout:
            if self._pending:
                sys.stdout.write("\r\033[K")
                sys.stdout.flush()
                self._pending = False
            print(text, file=stream or sys.stdout, flush=True)
        if self.file is not None:
            self.file.write(text + "\n")

    def transient(self, text: str) -> None:
        """A line that the next line replaces (a phase in progress); terminal only."""
        if self.tty:
            sys.stdout.write("\r\033[K" + text)
            sys.stdout.flush()
            self._pending = True

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


MARKS = {"done": "✓", "skip": "–", "fail": "✗", "run": "⋯"}


def row(mark: str, label: str, detail: str = "", seconds: float | None = None) -> str:
    secs = f"  {seconds:.1f}s" if seconds is not None else ""
    return f"  {MARKS.get(mark, mark)} {label:<17} {detail}{secs}".rstrip()
