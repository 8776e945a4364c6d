"""A small byte-level BPE for the demo model with every added token of the real V4.1 tokenizer.

The real file's added tokens (BOS, EOS, pad, the chat markers, `<think>`, `｜DSML｜`, placeholders, `<｜System｜>`)
are kept with their special flags, so chat encoding, reasoning and DSML parsing see exactly the tokens they see on
the real model; only ordinary text gets the smaller vocabulary. BOS, EOS and pad keep ids 0, 1, 2 as in the real
file. Digits are single tokens, which arithmetic needs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from dsflash.text.tokenizer import BOS, EOS, V41
from dsflash.text.tokenizer import Tokenizer as V41Tokenizer

PAD = "<｜▁pad▁｜>"
NOISE = "<｜place▁holder▁no▁799｜>"  # DSpark's noise token, as in the real V4.1 config (128799)


def reference_added() -> list[AddedToken]:
    """The real V4.1 tokenizer's added tokens in id order, with their special flags."""
    real = V41Tokenizer.bundled(V41).backend.get_added_tokens_decoder()
    return [AddedToken(t.content, special=t.special, normalized=False) for _, t in sorted(real.items())]


# a word keeps the one space after it, digits stand alone, a run of punctuation keeps its space, other blanks
# stand alone: a value's words are the same pieces wherever it stands (see train_tokenizer)
TRAILING = r"\p{L}+ ?|\p{N}|[^\s\p{L}\p{N}]+ ?|\s+"


def train_tokenizer(texts: Iterable[str], vocab_size: int, spaces: str = "leading") -> Tokenizer:
    """BPE of `vocab_size` ordinary tokens (bytes + merges, BOS/EOS/pad first) plus the real added tokens.

    spaces: "leading" splits text as GPT-2 does, a space opening the word after it (` Oslo`); "trailing" closes a
    word with the space after it (`Oslo ` inside a phrase, `Oslo` before punctuation or a marker), so a value copied
    from a question into an answer or a DSML argument is the same pieces in both (after `: ` or `in `, then after
    `>` or `</think>`), which with leading spaces it is not for its first word."""
    added = reference_added()
    splitter = re.compile("|".join(re.escape(t.content) for t in sorted(added, key=lambda t: -len(t.content))))
    tok = Tokenizer(models.BPE())
    if spaces == "trailing":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(TRAILING), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # added tokens never take part in merges: train on the text between them
    tok.train_from_iterator((piece for text in texts for piece in splitter.split(text) if piece), trainer)
    rest = [t for t in added if t.content not in (BOS, EOS, PAD)]
    tok.add_special_tokens([t for t in rest if t.special])
    tok.add_tokens([t for t in rest if not t.special])
    return _reorder(tok, added)


def _reorder(tok: Tokenizer, added: list[AddedToken]) -> Tokenizer:
    """Added tokens with the flags of the real file (add_tokens / add_special_tokens lose the order of mixing)."""
    spec = json.loads(tok.to_str())
    flags = {t.content: t.special for t in added}
    for entry in spec["added_tokens"]:
        entry["special"] = flags[entry["content"]]
        entry["normalized"] = False
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def word_pieces(tok: V41Tokenizer) -> list[str]:
    """The ordinary tokens that are lowercase letters alone, as text, in id order: what an invented training word
    is strung from (data.Generator.pieces), so that every such token is read and written in training."""
    texts = (tok.decode([i]) for i in range(tok.vocab_size))
    return [t for t in texts if t.isascii() and t.isalpha() and t.islower()]


def save(tok: Tokenizer, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (BOS/EOS by name, as the real checkpoint's config has them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "model_max_length": 65536}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
