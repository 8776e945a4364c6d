"""resolve_model_dir: a local directory, or a Hub repo id (optionally `@revision`) resolved in the HF cache."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from dsflash.checkpoint.names import INDEX, SINGLE
from dsflash.errors import ModelSourceError
from dsflash.paths import user_cache_home

REQUIRED = ("config.json", "tokenizer.json")
# what a download fetches: weights, config, tokenizer; not inference code, PDFs or evaluation data
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*"]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
TRUE = {"1", "on", "yes", "true"}


def resolve_model_dir(spec: str, revision: str | None = None) -> Path:
    """`spec` is a directory, or `org/name[@revision]` on the Hugging Face Hub -> a directory with every file."""
    local = Path(spec).expanduser()
    if local.is_dir():
        if revision is not None:
            raise ModelSourceError(f"--revision {revision} makes no sense for the local directory {local}")
        _require_files(local, f"model directory {local}")
        return local
    repo_id, _, at = spec.partition("@")
    if at:
        if revision is not None and revision != at:
            raise ModelSourceError(f"{spec} names revision {at!r} but revision {revision!r} was also given")
        revision = at
    if not REPO_ID.match(repo_id) or local.exists() or spec.startswith((".", "/", "~")):
        raise ModelSourceError(f"{spec} is neither a model directory nor a Hugging Face repo id (org/name)")
    return _from_hub(repo_id, revision or "main")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE read now (huggingface_hub reads it once at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE


def hub_cache_dir() -> Path:
    """The HF hub cache as huggingface_hub would compute it from the environment right now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return user_cache_home() / "huggingface" / "hub"


def _from_hub(repo_id: str, revision: str) -> Path:
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    cache = hub_cache_dir()
    offline = hub_offline()
    where = f"{repo_id}@{revision}"
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=ALLOW_PATTERNS,
        )
    except hf_errors.LocalEntryNotFoundError:
        raise ModelSourceError(
            f"{where} is not in the Hugging Face cache at {cache}"
            + (" and HF_HUB_OFFLINE=1 forbids downloading it" if offline else " and could not be downloaded")
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise ModelSourceError(f"no repo {repo_id} on the Hugging Face Hub (or no access to it)") from None
    except hf_errors.RevisionNotFoundError:
        raise ModelSourceError(f"repo {repo_id} has no revision {revision!r}") from None
    except (hf_errors.HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelSourceError(f"cannot fetch {where}: {first}") from None
    hint = " (HF_HUB_OFFLINE=1: nothing was downloaded)" if offline else ""
    _require_files(Path(folder), f"{where} in {cache}{hint}")
    return Path(folder)


def _require_files(folder: Path, what: str) -> None:
    """config.json, tokenizer.json and every weight file the index names must be there."""
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if (folder / INDEX).is_file():
        try:
            shards = set(json.loads((folder / INDEX).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelSourceError(f"{what}: unreadable {INDEX} ({e})") from None
        missing += sorted(s for s in shards if not (folder / s).is_file())
    elif not (folder / SINGLE).is_file():
        missing.append(f"{INDEX} or {SINGLE}")
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelSourceError(f"{what} is missing {len(missing)} file(s): {', '.join(missing[:5])}{more}")
