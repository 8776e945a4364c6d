"""server/protocol.py's models and conversion (no server): types, limits as the client sees them, the prefix-reuse
seams, vLLM's spellings; and render.py's objects against the documented response models."""

from __future__ import annotations

import pytest

from dsflash.errors import InvalidRequest, ModelSourceError
from dsflash.server import protocol, render, responses
from dsflash.server.protocol import ServedModel
from dsflash.service.api import MAX_CHOICES, Delta, PromptLogprob, TokenLogprob, TopLogprob, Usage

SERVED = ServedModel("m", ("alias",), max_len=1024, vocab_size=1000)
Q = [{"role": "user", "content": "hi"}]


def chat(**body):
    raw = {"messages": Q, **body}
    return protocol.to_chat(protocol.validate(protocol.ChatCompletionRequest, raw), raw, SERVED)[0]


def completion(**body):
    raw = {"prompt": "x", **body}
    return protocol.to_completion(protocol.validate(protocol.CompletionRequestBody, raw), SERVED)[0]


def rejected(fn, **body) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        fn(**body)
    return e.value


def test_cache_salt_reaches_the_request_and_must_be_a_string():
    assert chat(cache_salt="tenant-a").cache_salt == "tenant-a"
    assert completion(cache_salt="tenant-b").cache_salt == "tenant-b"
    assert chat().cache_salt is None
    for fn in (chat, completion):
        for bad in (5, True, ["a"], {"a": 1}):
            assert rejected(fn, cache_salt=bad).param == "cache_salt"


def test_completion_logprobs_true_is_one_as_in_vllm():
    assert completion(logprobs=True).options.logprobs == 1
    assert completion(logprobs=False).options.logprobs is None
    assert completion(logprobs=3).options.logprobs == 3
    assert rejected(completion, logprobs=21).param == "logprobs"


def test_min_tokens_and_prompt_logprobs_are_read():
    o = completion(min_tokens=5, max_tokens=8, prompt_logprobs=2).options
    assert (o.min_tokens, o.prompt_logprobs) == (5, 2)
    assert chat(prompt_logprobs=0).options.prompt_logprobs == 0
    e = rejected(completion, min_tokens=9, max_tokens=8)
    assert e.param == "min_tokens" and "max_tokens (8)" in str(e)
    assert rejected(chat, min_tokens=-1).param == "min_tokens"
    assert rejected(chat, prompt_logprobs=21).param == "prompt_logprobs"


@pytest.mark.parametrize("value", [-1, 0, 10**30, "5", True, 1.5])
def test_a_bad_max_tokens_names_the_limit_that_applies_never_an_internal_bound(value):
    e = rejected(chat, max_tokens=value) if value != 10**30 else None
    if e is None:  # huge but well-typed: the service's context check answers it (with the context's size)
        assert chat(max_tokens=value).options.max_tokens == value
        return
    assert e.param == "max_tokens" and "4611686018427387904" not in str(e) and str(1 << 62) not in str(e)


def test_strict_types_but_integral_floats_count_as_integers():
    assert chat(max_tokens=3.0).options.max_tokens == 3
    assert rejected(chat, temperature="1").param == "temperature"
    assert rejected(chat, stream="yes").param == "stream"
    assert rejected(chat, top_p=0).param == "top_p"
    assert rejected(chat, messages=[{"role": "user", "content": 5}]).param == "messages[0].content"
    assert rejected(chat, messages=[{"role": "wizard", "content": "x"}]).param == "messages[0].role"


def test_thinking_switches_and_chat_template_kwargs_are_closed():
    assert chat(thinking={"type": "disabled", "budget_tokens": 5}).chat.thinking is False
    assert chat(thinking=True).chat.thinking is True
    assert rejected(chat, thinking={"type": "maybe"}).param == "thinking.type"
    assert rejected(chat, chat_template_kwargs={"nope": 1}).param == "chat_template_kwargs.nope"


def test_unknown_fields_are_kept_for_the_log_and_known_unsupported_ones_refused():
    raw = {"messages": Q, "not_a_field": 1, "b": 2}
    assert protocol.unknown_fields(protocol.validate(protocol.ChatCompletionRequest, raw)) == ["b", "not_a_field"]
    assert rejected(chat, n=MAX_CHOICES + 1).param == "n"
    assert str(MAX_CHOICES) in str(rejected(chat, n=MAX_CHOICES + 1))
    assert (chat(n=3).options.n, completion(prompt="x", n=2, best_of=4).options.best_of) == (3, 4)
    assert rejected(completion, prompt="x", n=3, best_of=2).param == "best_of"
    assert rejected(completion, prompt="x", best_of=2, stream=True).param == "best_of"
    assert rejected(chat, tool_choice="required").param == "tool_choice"  # no tools to force
    fn = {"type": "function", "function": {"name": "f"}}
    assert (
        rejected(chat, tools=[fn], tool_choice={"type": "function", "function": {"name": "g"}}).param == "tool_choice"
    )
    assert rejected(chat, response_format={"type": "json_schema"}).param == "response_format"
    forced = chat(tools=[fn], tool_choice={"type": "function", "function": {"name": "f"}}, parallel_tool_calls=False)
    assert (forced.tool_choice, forced.tool_name, forced.parallel_tool_calls) == ("function", "f", False)
    assert chat(response_format={"type": "json_object"}).response_format.schema is None
    assert rejected(chat, presence_penalty=0.5).param == "presence_penalty"
    assert rejected(completion, prompt=["a", "b"]).param == "prompt"
    assert rejected(completion, prompt=[5000]).param == "prompt"  # outside the vocabulary
    with pytest.raises(ModelSourceError):
        chat(model="gpt-4")
    assert chat(model="alias").messages == Q


def _lp(token: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(token, logprob, tuple(token.encode()), (TopLogprob(token, logprob, tuple(token.encode())),), 0)


def _deltas(cached: int = 0) -> list[Delta]:
    positions = (None, (PromptLogprob(7, "a", -1.5, None), PromptLogprob(9, "b", -0.5, 1)))
    return [
        Delta("prompt", prompt_logprobs=positions),
        Delta("start"),
        Delta("reasoning", "think", logprobs=(_lp("think", -0.1),)),
        Delta("content", "Hi", logprobs=(_lp("Hi", -0.2),)),
        Delta("content", finish_reason="stop", usage=Usage(5, 2, 1, cached_tokens=cached)),
    ]


def test_renderings_match_the_documented_response_models_and_carry_cached_tokens():
    chat_meta = render.Meta("m", "chat", logprobs=True, include_usage=True, prompt_logprobs=True)
    body = render.full_chat(iter(_deltas(cached=3)), chat_meta)
    responses.ChatCompletionResponse.model_validate(body)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert body["prompt_logprobs"] == [
        None,
        {"7": {"logprob": -1.5, "rank": None, "decoded_token": "a"}, "9": {"logprob": -0.5, "rank": 1,
                                                                            "decoded_token": "b"}},
    ]  # fmt: skip
    chunks = list(render.stream_chat(iter(_deltas(cached=3)), chat_meta))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and chunks[0]["prompt_logprobs"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    meta = render.Meta("m", "completion", logprobs=True, include_usage=True, prompt_logprobs=True)
    body = render.full_completion(iter(_deltas(cached=4)), meta)
    responses.CompletionResponse.model_validate(body)
    assert body["choices"][0]["prompt_logprobs"][1]["9"]["rank"] == 1
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    chunks = list(render.stream_completion(iter(_deltas(cached=4)), meta))
    assert chunks[0]["choices"][0]["prompt_logprobs"] is not None
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:] if c["choices"])
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


def _choice(index: int, text: str, tokens: int, logprob: float) -> list[Delta]:
    return [
        Delta("start", index=index),
        Delta("content", text, index=index),
        Delta("content", finish_reason="length", usage=Usage(5, tokens), index=index, cumulative_logprob=logprob),
    ]


def test_several_choices_carry_their_index_and_usage_counts_the_prompt_once():
    a, b, c = _choice(0, "a", 2, -3.0), _choice(1, "b", 3, -1.0), _choice(2, "c", 4, -2.0)
    mixed = [a[0], b[0], b[1], a[1], c[0], c[1], b[2], c[2], a[2]]  # as the sequences' tokens come
    meta = render.Meta("m", "chat", include_usage=True, n=3)
    chunks = list(render.stream_chat(iter(mixed), meta))
    text = {i: "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"] and
                       ch["choices"][0]["index"] == i) for i in range(3)}  # fmt: skip
    assert text == {0: "a", 1: "b", 2: "c"}
    assert [ch["choices"][0]["delta"].get("role") for ch in chunks if ch["choices"]].count("assistant") == 3
    assert chunks[-1]["usage"]["prompt_tokens"] == 5 and chunks[-1]["usage"]["completion_tokens"] == 9
    body = render.full_chat(iter(mixed), meta)
    responses.ChatCompletionResponse.model_validate(body)
    assert [(ch["index"], ch["message"]["content"]) for ch in body["choices"]] == [(0, "a"), (1, "b"), (2, "c")]
    # best_of 3, n 2: the two of highest cumulative logprob, best first, re-indexed; usage counts what returns
    body = render.full_completion(iter(mixed), render.Meta("m", "completion", n=2))
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [(0, "b"), (1, "c")]
    assert body["usage"]["completion_tokens"] == 7 and body["usage"]["prompt_tokens"] == 5
