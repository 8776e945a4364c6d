"""Structured output through the real Engine and Generator: JSON schemas and forced tool calls on a runner whose
logits are random (what a random model looks like), 200 samples per schema validated with jsonschema, both
renderings of the same Deltas; thinking mode (the grammar starts after `</think>`); masked logprobs; 400s."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from dsflash.counters import ExpertCounters
from dsflash.errors import InvalidRequest
from dsflash.runtime.scheduler.engine import Engine
from dsflash.server import render
from dsflash.service.api import ChatRequest, GenerationOptions, JsonFormat
from dsflash.service.generator import Generator
from dsflash.text.chat import ChatOptions
from dsflash.text.tokenizer import Tokenizer

Q = [{"role": "user", "content": "Answer in JSON."}]
NO_THINK = ChatOptions(thinking=False)
SAMPLES = 200
TOOL_SAMPLES = 20  # a forced call is ~60 tokens, most of them the DSML tags
DRAWN = 4  # of each 200, samples drawn at temperature 1 (torch.multinomial over 129k tokens: ~4 ms a token); the
# rest are greedy on random logits, which differ at every step

S = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum_bool": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "tag": S},
                "required": ["id"],
                "additionalProperties": False,
            },
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["user", "level"],
        "additionalProperties": False,
    },
    "numbers_refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "boolean"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },  # fmt: skip
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/point"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["p", "n"],
        "additionalProperties": False,
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": S,
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"enum": ["c", "f"]},
                },  # fmt: skip
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


class RandomRunner:
    """Random logits over the vocabulary: rows of a pool drawn once (a draw per step would cost more than the
    grammar), walked with a stride and offset that change per sequence, so greedy sequences differ too; with
    `</think>` made likely every `think_after` steps when asked."""

    POOL = 97  # a prime: every stride 1..96 walks all rows

    def __init__(self, vocab_size: int, think_close: int | None = None, think_after: int = 3):
        self.vocab_size, self.max_len = vocab_size, 4096
        self.pool = torch.randn(self.POOL, vocab_size, generator=torch.Generator().manual_seed(5)) * 3
        self.think_close, self.think_after = think_close, think_after
        self.sequences, self.row, self.stride = 0, 0, 1

    def reset(self) -> None:
        self.sequences += 1
        self.row, self.stride = self.sequences % self.POOL, 1 + (self.sequences // self.POOL) % (self.POOL - 1)

    def forward(self, tokens, start_pos, all_logits):
        self.row = (self.row + self.stride) % self.POOL
        logits = self.pool[self.row]
        if self.think_close is not None and start_pos > 0 and start_pos % self.think_after == 0:
            logits = logits.clone()
            logits[self.think_close] = 100.0
        return logits.unsqueeze(0).expand(len(tokens) if all_logits else 1, -1)

    def counters(self) -> ExpertCounters:
        return ExpertCounters()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.bundled("v41")


@pytest.fixture(scope="module")
def gen(tok):
    engine = Engine(RandomRunner(tok.vocab_size), tok.eos_ids, max_queue=4).start()
    yield Generator(engine, tok, 4096)
    engine.close()


def fold(deltas, logprobs=False):
    """(full chat.completion message, the streamed chunks' content and tool calls joined)."""
    meta = render.Meta("m", "chat", logprobs=logprobs)
    full = render.full_chat(iter(deltas), meta)
    chunks = list(render.stream_chat(iter(deltas), meta))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or ()]
    return full, text, calls


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_outputs_validate_against_the_schema(gen, name):
    schema = SCHEMAS[name]
    validator = jsonschema.Draft202012Validator(schema)
    seen = set()
    for seed in range(SAMPLES):
        opts = GenerationOptions(max_tokens=120, seed=seed, temperature=1.0 if seed < DRAWN else 0.0)
        deltas = list(gen.stream(ChatRequest(Q, opts, NO_THINK, response_format=JsonFormat(schema))))
        full, streamed, _ = fold(deltas)
        choice = full["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        text = choice["message"]["content"]
        assert streamed == text
        validator.validate(json.loads(text))
        seen.add(text)
    # the samples differ (all 6 outputs enum_bool allows; 39 of array's): the mask constrains, the logits choose
    assert len(seen) >= {"enum_bool": 6, "array": 15}.get(name, 50)


def test_json_object_mode_starts_an_object(gen):
    # any object: free keys and strings run long on random logits, so this checks the start and, when one
    # finishes, the whole
    for seed in range(3):
        opts = GenerationOptions(max_tokens=24, seed=seed, temperature=0)
        full, _, _ = fold(list(gen.stream(ChatRequest(Q, opts, NO_THINK, response_format=JsonFormat()))))
        choice = full["choices"][0]
        assert choice["message"]["content"].startswith("{")
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("choice", ["required", "function"])
def test_forced_tool_calls_parse_and_validate(gen, choice):
    schemas = {t["function"]["name"]: jsonschema.Draft202012Validator(t["function"]["parameters"]) for t in TOOLS}
    names = set()
    for seed in range(TOOL_SAMPLES):
        opts = GenerationOptions(max_tokens=300, seed=seed, temperature=1.0 if seed < DRAWN else 0.0)
        name = "get_weather" if choice == "function" else None
        req = ChatRequest(Q, opts, NO_THINK, tools=TOOLS, tool_choice=choice, tool_name=name,
                          parallel_tool_calls=seed % 4 == 0)  # fmt: skip
        full, text, streamed_calls = fold(list(gen.stream(req)))
        c = full["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        calls = c["message"]["tool_calls"]
        assert calls and c["message"]["content"] is None and text == ""
        assert [x["function"] for x in calls] == [x["function"] for x in streamed_calls]
        if seed % 4:
            assert len(calls) == 1
        for call in calls:
            names.add(call["function"]["name"])
            schemas[call["function"]["name"]].validate(json.loads(call["function"]["arguments"]))
    assert names == ({"get_weather"} if choice == "function" else {"get_weather", "ping"})


def test_thinking_mode_reasons_freely_then_follows_the_grammar(tok):
    runner = RandomRunner(tok.vocab_size, think_close=tok.think_close_id, think_after=6)
    engine = Engine(runner, tok.eos_ids, max_queue=4).start()
    try:
        g = Generator(engine, tok, 4096)
        schema = SCHEMAS["nested"]
        for seed in range(5):
            opts = GenerationOptions(max_tokens=200, seed=seed, logprobs=3)
            deltas = list(
                g.stream(ChatRequest(Q, opts, ChatOptions(thinking=True), response_format=JsonFormat(schema)))
            )
            full, _, _ = fold(deltas, logprobs=True)
            msg = full["choices"][0]["message"]
            assert msg["reasoning_content"]  # unconstrained random text: no JSON grammar before `</think>`
            jsonschema.validate(json.loads(msg["content"]), schema)
            entries = full["choices"][0]["logprobs"]["content"]
            # the first token after `</think>` and its alternatives (masked: the rest are -inf, at the floor) all
            # start the object; unmasked, random logits would put random tokens there
            first = entries[next(i for i, e in enumerate(entries) if e["token"] == "</think>") + 1]
            alts = [t["token"] for t in first["top_logprobs"] if t["logprob"] > render.LOGPROB_FLOOR]
            assert first["token"] in alts and all('{"user":{"id":'.startswith(t) for t in alts), first
    finally:
        engine.close()


def test_masked_logprobs_sum_to_one_over_the_allowed_tokens(gen):
    opts = GenerationOptions(max_tokens=60, seed=1, logprobs=20)
    schema = SCHEMAS["enum_bool"]
    full, _, _ = fold(list(gen.stream(ChatRequest(Q, opts, NO_THINK, response_format=JsonFormat(schema)))), True)
    first = full["choices"][0]["logprobs"]["content"][0]
    # the only JSON that starts this object is '{"color":...': one token (or a few) hold all the mass
    assert first["logprob"] > -1e-3 or sum(2.718281828 ** t["logprob"] for t in first["top_logprobs"]) > 0.999


@pytest.mark.parametrize(
    "schema,needle",
    [({"type": "string", "if": {}}, "if"), ({"type": "string", "format": "weird"}, "weird")],
)
def test_unsupported_schema_features_are_named(gen, schema, needle):
    with pytest.raises(InvalidRequest) as e:
        gen.stream(ChatRequest(Q, GenerationOptions(max_tokens=4), NO_THINK, response_format=JsonFormat(schema)))
    assert e.value.param == "response_format" and needle in str(e.value)


def test_a_forced_tool_without_an_object_schema_is_refused(gen):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"anyOf": [{"type": "object"}]}}}]
    with pytest.raises(InvalidRequest) as e:
        gen.stream(ChatRequest(Q, GenerationOptions(max_tokens=4), NO_THINK, tools=bad, tool_choice="required"))
    assert e.value.param == "tool_choice" and "anyOf" in str(e.value)
