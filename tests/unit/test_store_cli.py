"""`dsflash store build|verify`: a build killed half-way resumes to the same bytes; verify names a bad record."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsflash.checkpoint.index import Checkpoint
from dsflash.cli.main import main
from dsflash.store.build import PAUSE_ENV, build_store
from dsflash.store.layout import MANIFEST, PARTIAL, StoreManifest, store_dir

MODEL = Path(__file__).resolve().parents[1] / "data" / "dsv41_tiny" / "tiny_a" / "model"
SRC = Path(__file__).resolve().parents[2] / "src"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != PAUSE_ENV}
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


def _cmd(*args) -> list[str]:
    return [sys.executable, "-m", "dsflash", "store", *args]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.timeout(180)
def test_killed_build_resumes_to_identical_bytes(tmp_path):
    root = tmp_path / "killed"
    d = store_dir(MODEL, root)
    args = _cmd("build", str(MODEL), "--tp", "2", "--format", "bfp4_b", "--cache-dir", str(root), "--no-progress")
    # 8 experts per backbone layer: after 20 records layers 0 and 1 are done and layer 2 is half written
    proc = subprocess.Popen(args, env=_env(**{PAUSE_ENV: "20"}), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "test pause" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, f"build exited early ({proc.poll()})"
            assert time.monotonic() < deadline, "build never reached the pause"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    m = StoreManifest.read(d)
    assert sorted(m.layers) == [0, 1] and not m.complete
    assert (d / ("layers.2.experts.bin" + PARTIAL)).is_file()
    before = {n: (d / n).stat() for n in ("layers.0.experts.bin", "layers.1.experts.bin")}

    done = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["kept"] == [0, 1] and row["built"] == list(range(2, 14))
    for n, st in before.items():  # finished layers were not rewritten
        after = (d / n).stat()
        assert (after.st_ino, after.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert not list(d.glob("*" + PARTIAL))

    # an uninterrupted build elsewhere gives the same files, byte for byte
    build_store(Checkpoint.open(MODEL), tmp_path / "clean", 2, "bfp4_b", progress=False)
    assert _files(d) == _files(store_dir(MODEL, tmp_path / "clean"))


def test_verify_cli_names_the_flipped_record(tmp_path, capsys):
    root = str(tmp_path)
    assert main(["store", "build", str(MODEL), "--tp", "4", "--format", "bfp8_b", "--cache-dir", root,
                 "--no-progress"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["built"] == list(range(14))
    assert main(["store", "verify", str(MODEL), "--cache-dir", root, "--decode", "4"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["ok"] and row["records"] == 104 and row["decoded"] == 4 and row["tp"] == 4

    d = store_dir(MODEL, tmp_path)
    g = StoreManifest.read(d).geometry
    at = 5 * g.record_bytes + 2 * g.stride + 17  # layer 9, expert 5, rank 2
    with open(d / "layers.9.experts.bin", "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    assert main(["store", "verify", str(MODEL), "--cache-dir", root]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsflash store: error: ") and len(err.splitlines()) == 1
    assert "layer 9 (layers.9) expert 5 rank 2" in err

    # the store is for TP 4 bfp8_b: anything else is another store, never this one used or replaced
    assert main(["store", "verify", str(MODEL), "--cache-dir", root, "--tp", "2"]) == 1
    assert "no expert store in" in capsys.readouterr().err
    assert main(["store", "build", str(MODEL), "--cache-dir", root, "--no-progress"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["tp"] == 1 and row["format"] == "bfp8_b"  # auto: the tiny store fits, so FP4 exactly
    assert row["store"] == str(d.parent / "weights-tp1-bfp8_b") and row["built"] == list(range(14))
    assert main(["store", "verify", str(MODEL), "--cache-dir", root, "--tp", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["store"] == row["store"]
    assert json.loads((d / MANIFEST).read_text())["tp"] == 4  # the first store as it was, flipped byte and all
    assert main(["store", "verify", str(MODEL), "--cache-dir", root]) == 1
    assert "layer 9 (layers.9) expert 5 rank 2" in capsys.readouterr().err


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["store", "verify", str(MODEL), "--cache-dir", str(tmp_path)]) == 1
    assert "no expert store in" in capsys.readouterr().err
    assert main(["store", "build", str(MODEL), "--tp", "3", "--cache-dir", str(tmp_path), "--no-progress"]) == 1
    assert "TP degree 3 does not divide moe_intermediate_size 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["store", "build", str(MODEL), "--format", "bfp2"])
