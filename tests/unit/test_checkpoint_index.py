"""index.py + verify.py: lazy reading of the official format and the inventory check on broken checkpoints."""

import contextlib
import io
import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsflash.checkpoint import writer
from dsflash.checkpoint.index import Checkpoint
from dsflash.errors import CheckpointError
from dsflash.formats import fp4, fp8

TINY = Path(__file__).resolve().parents[1] / "data" / "dsv41_tiny"
INDEX = "model.safetensors.index.json"


# ---- reading the fixtures ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["tiny_a", "tiny_b"])
def test_fixture_verifies_and_raw_matches_safetensors(case):
    ckpt = Checkpoint.open(TINY / case / "model")
    result = ckpt.verify()
    assert result["tensors"] == len(ckpt.names())
    assert ckpt.config.is_v41 and ckpt.files() == ["model.safetensors"]
    with safe_open(str(TINY / case / "model" / "model.safetensors"), "pt") as f:
        for name in sorted(f.keys()):
            theirs, ours = f.get_tensor(name), ckpt.raw(name)
            assert theirs.dtype == ours.dtype and theirs.shape == ours.shape
            assert torch.equal(theirs.view(torch.uint8), ours.view(torch.uint8)), name


def test_entry_and_stored_dtypes():
    ckpt = Checkpoint.open(TINY / "tiny_a" / "model")
    e = ckpt.entry("layers.1.engram.embed.weight")
    assert (e.dtype, e.shape, e.file.name, e.nbytes) == ("F8_E4M3", (660, 32), "model.safetensors", 660 * 32)
    with open(e.file, "rb") as f:
        f.seek(e.offset)
        assert f.read(e.nbytes) == ckpt.raw(e.name).view(torch.uint8).numpy().tobytes()
    dtypes = {
        "embed.weight": torch.bfloat16,
        "layers.0.hc_attn_fn": torch.float32,
        "layers.0.attn.wq_a.weight": torch.float8_e4m3fn,
        "layers.0.attn.wq_a.scale": torch.float8_e8m0fnu,
        "layers.0.ffn.experts.0.w1.weight": torch.int8,
    }
    for name, dtype in dtypes.items():
        assert ckpt.raw(name).dtype == dtype


def test_raw_is_zero_copy():
    ckpt = Checkpoint.open(TINY / "tiny_a" / "model")
    a, b = ckpt.raw("embed.weight"), ckpt.raw("embed.weight")
    assert a.data_ptr() == b.data_ptr()  # both views of the same mapped pages, not copies
    before = (TINY / "tiny_a" / "model" / "model.safetensors").read_bytes()
    a.add_(1)  # copy-on-write: the file never changes
    assert (TINY / "tiny_a" / "model" / "model.safetensors").read_bytes() == before


def test_tensor_dequantizes_each_format():
    ckpt = Checkpoint.open(TINY / "tiny_b" / "model")
    raw, block = ckpt.raw, ckpt.config.fp8_block
    name = "layers.1.attn.wq_b"
    assert torch.equal(
        ckpt.tensor(name + ".weight"), fp8.dequant_block(raw(name + ".weight"), raw(name + ".scale"), 32)
    )
    name = "layers.3.ffn.experts.2.w2"
    w = ckpt.tensor(name + ".weight")
    assert w.shape == (96, 32) and torch.equal(w, fp4.dequant(raw(name + ".weight"), raw(name + ".scale")))
    table = ckpt.tensor("layers.2.engram.embed.weight")
    rows = torch.tensor([0, 5, 1361])
    want = fp8.dequant_rows(raw("layers.2.engram.embed.weight"), raw("layers.2.engram.embed.scale"), rows, 32)
    assert table.shape == (1362, 32) and torch.equal(table[rows], want)
    assert ckpt.tensor("embed.weight").dtype == torch.float32
    assert torch.equal(ckpt.tensor("norm.weight"), raw("norm.weight").float())
    assert block == 32


def test_single_file_without_index(tmp_path):
    shutil.copytree(TINY / "tiny_b" / "model", tmp_path / "m")
    (tmp_path / "m" / INDEX).unlink()
    ckpt = Checkpoint.open(tmp_path / "m")
    assert ckpt.verify()["tensors"] == 613 and len(ckpt.names()) == 613


def test_open_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not a model directory"):
        Checkpoint.open(tmp_path / "nope")
    shutil.copyfile(TINY / "tiny_b" / "model" / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="neither"):
        Checkpoint.open(tmp_path)
    (tmp_path / INDEX).write_text("{not json")
    with pytest.raises(CheckpointError, match="JSON"):
        Checkpoint.open(tmp_path)
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"embed.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside"):
        Checkpoint.open(tmp_path)
    with pytest.raises(CheckpointError, match="no tensor"):
        Checkpoint.open(TINY / "tiny_b" / "model").tensor("layers.99.attn.wq_a.weight")


# ---- broken checkpoints -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    config = json.loads((TINY / "tiny_b" / "model" / "config.json").read_text())
    return writer.write_checkpoint(config, tmp_path_factory.mktemp("sharded"), seed=3, shards=2)


@pytest.fixture
def broken(sharded, tmp_path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(sharded, out)
    return out


SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _edit_shard(model: Path, file: str, edit) -> None:
    """Rewrite one shard with the safetensors library after `edit(tensors)`, and the index to match."""
    path = model / file
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in sorted(f.keys())}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = json.loads((model / INDEX).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file}
    index["weight_map"].update({k: file for k in tensors})
    index["metadata"]["total_size"] = None  # not what this test is about
    (model / INDEX).write_text(json.dumps(index))


def _shard_of(model: Path, name: str) -> str:
    return json.loads((model / INDEX).read_text())["weight_map"][name]


def _fails(model: Path, *needles: str) -> str:
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(model).verify()
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def test_missing_tensor(broken):
    name = "layers.3.attn.wq_b.scale"
    _edit_shard(broken, _shard_of(broken, name), lambda t: t.pop(name))
    msg = _fails(broken, "1 missing tensor:", name)
    assert "unexpected" not in msg and "mis-shaped" not in msg


def test_extra_tensor(broken):
    _edit_shard(broken, SHARD1, lambda t: t.update({"layers.0.attn.bonus.weight": torch.zeros(4, 4)}))
    _fails(broken, "1 unexpected tensor:", "layers.0.attn.bonus.weight")


def test_mis_shaped_tensor(broken):
    name = "layers.2.attn.wkv.weight"
    _edit_shard(broken, _shard_of(broken, name), lambda t: t.update({name: t[name][:64].contiguous()}))
    _fails(broken, "mis-shaped", name, "expected F8_E4M3 [96, 96], found F8_E4M3 [64, 96]")


def test_wrong_dtype(broken):
    name = "layers.0.attn_norm.weight"
    _edit_shard(broken, _shard_of(broken, name), lambda t: t.update({name: t[name].float()}))
    _fails(broken, name, "expected BF16 [96], found F32 [96]")


def test_truncated_shard(broken):
    path = broken / SHARD2
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    _fails(broken, SHARD2, "truncated")


def test_trailing_bytes(broken):
    with open(broken / SHARD1, "ab") as f:
        f.write(b"\0" * 16)
    _fails(broken, SHARD1, "16 trailing bytes")


def test_missing_shard(broken):
    (broken / SHARD1).unlink()
    msg = _fails(broken, f"shard {SHARD1} is missing")
    assert "missing tensors" not in msg  # the shard is the cause, not hundreds of tensors


def test_index_names_a_shard_that_does_not_exist(broken):
    index = json.loads((broken / INDEX).read_text())
    index["weight_map"]["embed.weight"] = "model-00009-of-00009.safetensors"
    (broken / INDEX).write_text(json.dumps(index))
    _fails(broken, "model-00009-of-00009.safetensors is missing", "embed.weight")


def test_corrupt_header_json(broken):
    path = broken / SHARD2
    data = bytearray(path.read_bytes())
    data[8:20] = b"#" * 12
    path.write_bytes(bytes(data))
    _fails(broken, SHARD2, "not valid JSON")


def test_corrupt_header_length(broken):
    path = broken / SHARD1
    data = bytearray(path.read_bytes())
    data[0:8] = struct.pack("<Q", 1 << 40)
    path.write_bytes(bytes(data))
    _fails(broken, SHARD1, "corrupt header length")


def _rewrite_header(path: Path, edit) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_data_offsets_outside_the_file(broken):
    name = "embed.weight"
    path = broken / _shard_of(broken, name)

    def edit(header):
        size = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
        header[name]["data_offsets"] = [10**9, 10**9 + size]

    _rewrite_header(path, edit)
    _fails(broken, path.name, name)


def test_offsets_that_do_not_fit_the_shape(broken):
    name = "norm.weight"
    path = broken / _shard_of(broken, name)

    def edit(header):
        b, e = header[name]["data_offsets"]
        header[name]["data_offsets"] = [b, e - 2]

    _rewrite_header(path, edit)
    _fails(broken, name, "data_offsets")


def test_index_and_header_disagree(broken):
    index = json.loads((broken / INDEX).read_text())
    name = next(k for k, v in index["weight_map"].items() if v == SHARD1)
    index["weight_map"][name] = SHARD2
    (broken / INDEX).write_text(json.dumps(index))
    _fails(
        broken,
        f"tensor listed in the index but not in {SHARD2}",
        name,
        f"tensor in {SHARD1} that the index does not list",
    )


def test_total_size_mismatch(broken):
    index = json.loads((broken / INDEX).read_text())
    index["metadata"]["total_size"] += 1
    (broken / INDEX).write_text(json.dumps(index))
    _fails(broken, "total_size")


def test_wrong_config_for_the_weights(broken):
    config = json.loads((broken / "config.json").read_text())
    config["text_config"]["n_routed_experts"] = 5  # the weights have 6 experts per layer
    (broken / "config.json").write_text(json.dumps(config))
    _fails(broken, "unexpected tensors", "layers.0.ffn.experts.5.w1.weight", "mis-shaped", "layers.0.ffn.gate.weight")


def test_many_problems_are_listed_briefly(broken):
    names = [f"layers.{i}.attn.wq_b.scale" for i in range(8)]
    for file in (SHARD1, SHARD2):
        _edit_shard(broken, file, lambda t: [t.pop(n) for n in names if n in t])
    msg = _fails(broken, "8 missing tensors", "(+4 more)")
    assert len(msg) < 500


# ---- the CLI ------------------------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI in this process (`python -m dsflash` itself is driven by the server and store CLI tests): a fresh
    interpreter would spend seconds importing torch for a check that takes milliseconds."""
    from dsflash.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_cli_verify_ok_and_broken(broken):
    out = _cli("checkpoint", "verify", str(broken))
    assert out.returncode == 0 and out.stdout.strip() == "ok: 613 tensors, 2609639 bytes"
    (broken / SHARD2).write_bytes((broken / SHARD2).read_bytes()[:-7])
    out = _cli("checkpoint", "verify", str(broken))
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert lines[0].startswith("dsflash checkpoint: error: ") and "truncated" in lines[0]


def test_cli_write_then_verify(tmp_path):
    out = _cli(
        "checkpoint", "write", str(TINY / "tiny_a" / "model"), str(tmp_path / "w"), "--seed", "2", "--shards", "2"
    )
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "w").glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert Checkpoint.open(tmp_path / "w").verify()["tensors"] == 1081


def test_cli_errors_in_process(tmp_path, capsys):
    from dsflash.cli.main import main

    assert main(["checkpoint", "write", str(tmp_path / "missing.json"), str(tmp_path / "x")]) == 1
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("dsflash checkpoint: error: ") for line in err)
