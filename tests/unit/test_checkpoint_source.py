"""source.py: local directories and Hub repo ids resolved in a fake HF cache, never over the network."""

import os
import shutil
from pathlib import Path

import pytest

from dsflash.checkpoint.source import resolve_model_dir
from dsflash.errors import ModelSourceError

MODEL = Path(__file__).resolve().parents[1] / "data" / "dsv41_tiny" / "tiny_b" / "model"
REPO = "deepseek-ai/DeepSeek-V4.1-Flash"
MAIN = "a" * 40
OLD = "b" * 40


def _snapshot(cache: Path, commit: str, refs: list[str], skip: tuple[str, ...] = ()) -> Path:
    """The layout huggingface_hub writes: blobs/<hash>, snapshots/<commit>/<file> -> ../../blobs/<hash>, refs/<name>."""
    repo = cache / ("models--" + REPO.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for i, src in enumerate(sorted(MODEL.iterdir())):
        if src.name in skip:
            continue
        blob = repo / "blobs" / f"{commit[:8]}{i:032d}"
        shutil.copyfile(src, blob)
        os.symlink(os.path.relpath(blob, snap), snap / src.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "hf" / "hub"
    root.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def test_local_directory():
    assert resolve_model_dir(str(MODEL)) == MODEL


def test_local_directory_missing_files(tmp_path):
    shutil.copyfile(MODEL / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelSourceError, match="tokenizer.json, model.safetensors.index.json or model.safetensors"):
        resolve_model_dir(str(tmp_path))


def test_repo_id_in_cache(cache):
    snap = _snapshot(cache, MAIN, ["main"])
    assert resolve_model_dir(REPO) == snap
    assert (resolve_model_dir(REPO) / "config.json").is_file()


def test_repo_id_with_revision(cache):
    main = _snapshot(cache, MAIN, ["main"])
    old = _snapshot(cache, OLD, ["v1"])
    assert resolve_model_dir(f"{REPO}@v1") == old
    assert resolve_model_dir(f"{REPO}@{OLD}") == old
    assert resolve_model_dir(REPO, revision="v1") == old
    assert resolve_model_dir(f"{REPO}@main") == main
    with pytest.raises(ModelSourceError, match="also given"):
        resolve_model_dir(f"{REPO}@v1", revision="main")


def test_hf_home_locates_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snap = _snapshot(tmp_path / "home" / "hub", MAIN, ["main"])
    assert resolve_model_dir(REPO) == snap


def test_offline_and_not_cached(cache):
    with pytest.raises(ModelSourceError) as info:
        resolve_model_dir(REPO)
    msg = str(info.value)
    assert REPO in msg and "HF_HUB_OFFLINE" in msg and str(cache) in msg
    _snapshot(cache, MAIN, ["main"])
    with pytest.raises(ModelSourceError, match="@v9"):
        resolve_model_dir(f"{REPO}@v9")


def test_offline_and_files_missing(cache):
    _snapshot(cache, MAIN, ["main"], skip=("model.safetensors", "tokenizer.json"))
    with pytest.raises(ModelSourceError) as info:
        resolve_model_dir(REPO)
    msg = str(info.value)
    assert "missing 2 file(s)" in msg and "tokenizer.json" in msg and "model.safetensors" in msg
    assert "HF_HUB_OFFLINE" in msg


@pytest.mark.parametrize("spec", ["./no/such/dir", "not a repo", "a/b/c"])
def test_neither_directory_nor_repo(cache, spec):
    with pytest.raises(ModelSourceError, match="neither"):
        resolve_model_dir(spec)
