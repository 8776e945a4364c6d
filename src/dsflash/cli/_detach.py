"""`dsflash serve --detach`: start the server in the background, relay its boot rows, return once it is ready."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time

from dsflash.server.registry import new_log_path, servers

NOT_CARRIED = {"help", "detach", "api_key", "_child", "_log", "_key_was_flag"}  # the API key travels in the environment


def child_argv(args) -> list[str]:
    """The same serve command without --detach: every flag of serve's parser with the value it was given (so that a
    new flag is carried without a word here)."""
    from dsflash.cli.serve import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    actions = [a for a in sub.choices["serve"]._actions if a.dest not in NOT_CARRIED]
    argv = [sys.executable, "-m", "dsflash", "serve"]
    argv += [getattr(args, a.dest) for a in actions if not a.option_strings and getattr(args, a.dest) is not None]
    for a in actions:
        value = getattr(args, a.dest, None)
        if not a.option_strings or value is None or value is False:
            continue
        argv += [a.option_strings[0]] if value is True else [a.option_strings[0], str(value)]
    return argv


def detach(args, choice) -> int:
    log_path = new_log_path(choice.slug, args.port)
    env = dict(os.environ)
    key_flag = []
    if args.api_key:
        env["DSFLASH_API_KEY"] = args.api_key
        key_flag = ["--_key_was_flag"]  # the card then says where the key came from
    with open(log_path, "ab") as log, open(os.devnull, "rb") as devnull:
        child = subprocess.Popen(
            [*child_argv(args), "--_child", "--_log", str(log_path), *key_flag],
            stdin=devnull,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # survives the terminal that started it
        )
    pos = 0
    try:
        while True:
            pos = _relay(log_path, pos)
            rec = next((r for r in servers(clean=False) if r.pid == child.pid), None)
            if rec is not None and rec.status == "ready":
                time.sleep(0.1)
                _relay(log_path, pos)
                return 0
            code = child.poll()
            if code is not None:
                _relay(log_path, pos)
                print(
                    f"dsflash serve: the server exited with code {code} while booting (log: {log_path})",
                    file=sys.stderr,
                )
                return 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        print(
            f"\nstopped watching; the server keeps booting in the background (pid {child.pid}).\n"
            f"  dsflash logs {choice.model_id} --follow · dsflash stop {choice.model_id}"
        )
        return 0


def _relay(path, pos: int) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(pos)
            data = f.read()
    except OSError:
        return pos
    if data:
        with contextlib.suppress(OSError):  # a closed stdout (`| head`) must not stop the wait for readiness
            sys.stdout.write(data.decode("utf-8", errors="replace"))
            sys.stdout.flush()
    return pos + len(data)
