"""Engram's compressed token map: token ids that normalise to the same text share one id (arch §5.7.1)."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, normalizers

# a private-use character, so a token that is exactly one space survives Strip() instead of
# collapsing to "" and merging with unrelated tokens
_SENTINEL = "\ue000"


def _normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def compressed_token_map(backend: Tokenizer) -> list[int]:
    """One compressed id per token id (ids in order of first appearance); len = vocab with added tokens."""
    norm = _normalizer()
    new_ids: dict[str, int] = {}
    out = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte: nothing to normalise, key it by its raw form
            key = backend.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        out.append(new_ids.setdefault(key, len(new_ids)))
    return out
