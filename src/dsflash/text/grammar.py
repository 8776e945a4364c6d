"""Structured output as token masks: a JSON schema, or a forced DSML tool call, compiled by llguidance into a grammar
over this tokenizer; a GrammarState per sequence answers which tokens may come next (runtime's TokenConstraint).

The JSON is compact (no whitespace between tokens): a grammar that allows free whitespace lets a weak model pad a
value forever and never finish. A forced tool call writes every parameter as JSON (string="false"), each constrained
by its property's schema, so its arguments are valid against the tool's schema after the DSML parser reads them.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from dsflash.errors import InvalidRequest
from dsflash.text.tokenizer import DSML, V41, Tokenizer, normalize_release
from dsflash.text.tools import SYNTAX

JSON_OPTIONS = {"whitespace_flexible": False}
CACHED_GRAMMARS = 64  # compiled schemas kept: agents send the same few schemas again and again

_ll_lock = threading.Lock()
_ll_tokenizers: dict[int, tuple[Tokenizer, llguidance.LLTokenizer]] = {}


def ll_tokenizer(tok: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tok` (its token trie), built once per tokenizer: ~3 s for DeepSeek's 129k vocabulary."""
    with _ll_lock:
        hit = _ll_tokenizers.get(id(tok))
        if hit is None or hit[0] is not tok:
            lt = llguidance.LLTokenizer(
                tok.backend.to_str(),
                n_vocab=tok.vocab_size,
                eos_token=tok.eos_id,
                slices=llguidance.LLTokenizer.json_slices(),
            )
            hit = _ll_tokenizers[id(tok)] = (tok, lt)
        return hit[1]


# ---- grammars (llguidance's JSON form, as text) ---------------------------------------------------------------------
def json_schema_grammar(schema: Mapping) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(dict(schema), overrides=JSON_OPTIONS)


def json_object_grammar() -> str:
    """Any JSON object (response_format json_object)."""
    return json_schema_grammar({"type": "object"})


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _lit(text: str, dsml_id: int | None) -> str:
    """A Lark sequence spelling `text`, with ｜DSML｜ as its own token where the vocabulary has one (as the model
    writes it)."""
    if dsml_id is None:
        return _lark_str(text)
    parts = text.split(DSML)
    out = [_lark_str(parts[0])] if parts[0] else []
    for part in parts[1:]:
        out.append(f"<[{dsml_id}]>")
        if part:
            out.append(_lark_str(part))
    return " ".join(out)


def _writable(name, where: str) -> str:
    """A tool or parameter name as DSML can write it inside name="..."."""
    if not isinstance(name, str) or not name or '"' in name or "<" in name:
        raise InvalidRequest(f"{where}: the name {name!r} cannot be written in a DSML call", param="tool_choice")
    return name


def _properties(name: str, params) -> tuple[list[tuple[str, dict, bool]], dict]:
    """A tool's parameters schema -> ([(property, its schema, required)], the root's definitions for $ref)."""
    params = {"type": "object"} if params is None else params
    where = f"tools[{name!r}].function.parameters"

    def refuse(what: str):
        raise InvalidRequest(f"{where}: {what}", param="tool_choice")

    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        refuse("a forced tool call needs an object schema")
    bad = sorted(k for k in ("anyOf", "oneOf", "allOf", "$ref", "not", "if") if k in params)
    if bad:
        refuse(f"unsupported for a forced tool call: {', '.join(bad)}")
    props, required = params.get("properties") or {}, params.get("required") or []
    if not isinstance(props, Mapping) or not isinstance(required, list):
        refuse("properties must be an object and required an array")
    out = []
    for key, sub in props.items():
        if not isinstance(sub, Mapping | bool):
            refuse(f"properties[{key!r}] must be a schema (an object)")
        out.append((_writable(key, where), {} if sub is True else dict(sub), key in required))
    missing = set(map(str, required)) - set(props)
    if missing:
        refuse(f"required names no property: {sorted(missing)}")
    return out, {k: params[k] for k in ("$defs", "definitions") if k in params}


def tool_call_grammar(tools: Sequence[Mapping], name: str | None = None, parallel: bool = True,
                      release: str = V41, dsml_id: int | None = None) -> str:  # fmt: skip
    """A DSML block calling `name` (or any of `tools`; several calls if `parallel`) with schema-valid arguments."""
    s = SYNTAX[normalize_release(release)]
    fns = [t["function"] for t in tools if t.get("type") == "function"]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name]
    rules, invokes = [], []
    for i, fn in enumerate(fns):
        props, defs = _properties(_writable(fn.get("name"), "tools"), fn.get("parameters"))
        body = []
        for j, (key, sub, required) in enumerate(props):
            head = _lit(f'<{DSML}{s.parameter} name="{key}" string="false">', dsml_id)
            value = json.dumps({**defs, **sub, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)
            rules.append(f'p{i}_{j}: {head} %json {value} {_lit(f"</{DSML}{s.parameter}>", dsml_id)} "\\n"')
            body.append(f"p{i}_{j}" + ("" if required else "?"))
        head = _lit(f'<{DSML}{s.invoke} name="{fn["name"]}">', dsml_id)
        rules.append(f'inv{i}: {head} "\\n" {" ".join(body)} {_lit(f"</{DSML}{s.invoke}>", dsml_id)}')
        invokes.append(f"inv{i}")
    call = " | ".join(invokes)
    more = ' ("\\n" call)*' if parallel else ""
    start = (
        f'start: {_lit(f"<{DSML}{s.block}>", dsml_id)} "\\n" call{more} "\\n" {_lit(f"</{DSML}{s.block}>", dsml_id)}'
    )
    lark = "\n".join([start, f"call: {call}", *rules])
    return llguidance.LLMatcher.grammar_from_lark(lark)


# ---- compiled grammars and their per-sequence state ---------------------------------------------------------------
@dataclass(frozen=True)
class Grammar:
    """A grammar checked against a tokenizer; calling it gives a fresh GrammarState (SamplingParams.constraint).
    after: a token id the grammar starts after (`</think>` in thinking mode), or None: from the first token."""

    template: llguidance.LLMatcher
    vocab_size: int
    eos_id: int
    after: int | None = None

    def __call__(self) -> GrammarState:
        return GrammarState(self.template.deep_copy(), self.vocab_size, self.eos_id, self.after)

    def starting_after(self, token: int | None) -> Grammar:
        return Grammar(self.template, self.vocab_size, self.eos_id, token)


class GrammarState:
    """allowed() / advance(token) over one llguidance matcher; free (None) until the `after` token, if any."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_id: int, after: int | None):
        self.matcher, self.vocab_size, self.eos_id = matcher, vocab_size, eos_id
        self.waiting = after
        self._bits = allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> np.ndarray | None:
        if self.waiting is not None:
            return None
        if self.matcher.is_error():  # only a token the mask forbade gets here: end the sequence rather than run on
            out = np.zeros((self.vocab_size + 7) // 8, dtype=np.uint8)
            out[self.eos_id // 8] = 1 << (self.eos_id % 8)
            return out
        fill_next_token_bitmask(self.matcher, self._bits)
        return self._bits[0].view(np.uint8)  # int32 words, little-endian: the same bits in byte order

    def advance(self, token: int) -> None:
        if self.waiting is not None:
            if token == self.waiting:
                self.waiting = None
            return
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)

    @property
    def accepting(self) -> bool:
        return self.waiting is None and self.matcher.is_accepting()


class GrammarCache:
    """Grammars compiled for one tokenizer, by their source text; an unsupported schema is an InvalidRequest naming
    what llguidance could not do."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._lock = threading.Lock()
        self._done: OrderedDict[str, Grammar] = OrderedDict()

    def compile(self, grammar: str, param: str) -> Grammar:
        with self._lock:
            hit = self._done.get(grammar)
            if hit is not None:
                self._done.move_to_end(grammar)
                return hit
        lt = ll_tokenizer(self.tok)
        try:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lt)
        except Exception as e:  # the engine's own refusal of a grammar it cannot build is the client's 400
            is_error, messages = True, [str(e)]
        if is_error:  # the first line: a Lark grammar's error quotes the whole grammar after it
            first = re.sub(r"^at \d+\(\d+\): ", "", "; ".join(messages).splitlines()[0])
            raise InvalidRequest(f"{param}: not supported by the grammar engine: {first}", param=param)
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{param}: not supported by the grammar engine: {matcher.get_error()}", param=param)
        out = Grammar(matcher, self.tok.vocab_size, self.tok.eos_id)
        with self._lock:
            self._done[grammar] = out
            while len(self._done) > CACHED_GRAMMARS:
                self._done.popitem(last=False)
        return out

    def json_schema(self, schema: Mapping | None, param: str = "response_format") -> Grammar:
        if schema is None:
            return self.compile(json_object_grammar(), param)
        try:
            source = json_schema_grammar(schema)
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"{param}: {e}", param=param) from None
        return self.compile(source, param)

    def tool_call(self, tools: Sequence[Mapping], name: str | None, parallel: bool, release: str) -> Grammar:
        dsml_id = self.tok.token_to_id(DSML)
        return self.compile(tool_call_grammar(tools, name, parallel, release, dsml_id), "tool_choice")
