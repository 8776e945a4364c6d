"""`dsflash serve`'s flags: checked before anything starts, and carried whole into a detached server."""

import os
import subprocess
import sys

from dsflash.cli._detach import child_argv
from dsflash.cli.main import build_parser

# every flag a user can give, each away from its default
EVERY_FLAG = [
    "serve", "some/model", "--profile", "long", "--host", "0.0.0.0", "--port", "20007", "--tp", "2",
    "--expert-slots", "99", "--expert-format", "bfp8_b", "--device", "cpu", "--backend", "reference",
    "--max-queue", "3", "--max-model-len", "777", "--prefill-chunk", "2048", "--max-num-seqs", "4",
    "--max-num-batched-tokens", "300", "--prefill-step-factor", "3", "--cache-dir", "/tmp/c", "--rebuild",
    "--default-chat-template-kwargs", '{"thinking": true}', "--shutdown-grace", "7", "--record-routing", "/tmp/r.jsonl",
    "--enforce-eager", "--max-tokens-default", "100", "--max-tokens-limit", "200", "--no-prefix-cache",
    "--prefix-cache-gb", "0.5", "--prefix-cache-dir", "/tmp/p", "--prefix-cache-disk-gb", "3",
    "--allowed-origins", "http://a.example", "--allow-long-context", "--speculative", "dspark",
    "--num-speculative-tokens", "2",
]  # fmt: skip
NOT_CARRIED = {"command", "detach", "api_key", "_child", "_log", "_key_was_flag", "run"}  # the key: in the environment


def test_a_detached_server_gets_every_flag_it_was_given():
    parser = build_parser()
    given = parser.parse_args([*EVERY_FLAG, "--detach"])
    argv = child_argv(given)
    assert argv[:4] == [sys.executable, "-m", "dsflash", "serve"]
    child = parser.parse_args(argv[3:])
    want = {k: v for k, v in vars(given).items() if k not in NOT_CARRIED}
    assert {k: v for k, v in vars(child).items() if k not in NOT_CARRIED} == want
    defaults = vars(parser.parse_args(["serve"]))
    assert all(want[k] != defaults[k] for k in want), "a flag left at its default proves nothing"


def test_a_prefill_chunk_below_one_is_refused_in_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "dsflash", "serve", "--prefill-chunk", "0"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == ["dsflash serve: error: --prefill-chunk must be >= 1"]


def test_ps_stop_and_logs_read_the_registry_without_torch(tmp_path):
    code = (
        "import sys; import dsflash.cli.main as m; m.build_parser(); "
        "import dsflash.cli.ps, dsflash.cli.stop, dsflash.cli.logs, dsflash.server.registry as r; r.servers(); "
        "sys.exit('torch' in sys.modules)"
    )
    env = {**os.environ, "DSFLASH_STATE": str(tmp_path)}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0


def test_prefix_cache_flags_reach_the_engine_spec():
    from dsflash.cli._engine import engine_spec
    from dsflash.cli.serve import boot_options

    parser = build_parser()
    spec = engine_spec(parser.parse_args(["serve", "--prefix-cache-gb", "0.5", "--prefix-cache-dir", "/tmp/p"]))
    assert spec.prefix_cache and spec.prefix_cache_gb == 0.5 and spec.prefix_cache_dir == "/tmp/p"
    assert not boot_options(parser.parse_args(["serve", "--no-prefix-cache"])).engine.prefix_cache
    # a detached server keeps reuse on unless told otherwise
    child = parser.parse_args(child_argv(parser.parse_args(["serve", "--detach"]))[3:])
    assert engine_spec(child).prefix_cache


def test_serve_help_shows_every_default():
    """Every serve flag's help says what it is when not given (argparse's "(default: …)" or the help's own)."""
    import argparse

    from dsflash.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    fmt = serve.formatter_class("dsflash serve")
    missing = [
        a.option_strings[0]
        for a in serve._actions
        if a.option_strings
        and a.help != argparse.SUPPRESS
        and not isinstance(a, argparse._HelpAction)
        and "default" not in fmt._get_help_string(a).lower()
    ]
    assert missing == []
    assert "--allowed-origins" in serve.format_help() and "--allow-long-context" in serve.format_help()
