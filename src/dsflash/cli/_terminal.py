"""The terminal side shared by the subcommands: help that shows defaults, a person's console lines (to the terminal
and a server's log file) and the boot's progress rows. Light on purpose: every subcommand's parser imports it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where the help already says what an unset flag means."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "(default" in text:
            return text
        return super()._get_help_string(action)


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
