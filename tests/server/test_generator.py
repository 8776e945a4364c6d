"""service.Generator on forced token streams (a scripted runner behind the real Engine): the `</think>` split in one
chunk and across chunks, stops, logprobs, usage, tool calls, and both renderings of the same Deltas."""

from __future__ import annotations

import json

import pytest

from dsflash.errors import ContextTooLong, EngineDead, InvalidRequest, NotReady, Overloaded
from dsflash.runtime.scheduler.engine import Engine
from dsflash.server import render
from dsflash.service.api import ChatRequest, CompletionRequest, GenerationOptions
from dsflash.service.generator import Generator
from dsflash.text.chat import ChatOptions
from dsflash.text.tokenizer import Tokenizer
from tests.server.scripted import ScriptedRunner

Q = [{"role": "user", "content": "What is 6 x 7?"}]
GREEDY = GenerationOptions(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.bundled("v41")


@pytest.fixture()
def make(tok):
    engines = []

    def make(script: list[int], max_len: int = 4096):
        runner = ScriptedRunner(script, tok.vocab_size, eos=tok.eos_id, max_len=max_len)
        engine = Engine(runner, tok.eos_ids, max_queue=4).start()
        engines.append(engine)
        return Generator(engine, tok, max_len), runner

    yield make
    for e in engines:
        e.close()


def ids(tok, *parts) -> list[int]:
    """Token ids of text parts, each part encoded on its own (so its tokens are exactly what we chose)."""
    out = []
    for p in parts:
        out += [p] if isinstance(p, int) else tok.encode(p)
    return out


def run(gen, req):
    deltas = list(gen.stream(req))
    kinds = {k: "".join(d.text for d in deltas if d.kind == k) for k in ("reasoning", "content", "prompt")}
    return deltas, kinds


def test_think_close_as_one_token_splits_reasoning_and_content(tok, make):
    script = ids(tok, "Six sevens.", tok.think_close_id, "It is 42.", tok.eos_id)
    gen, _ = make(script)
    deltas, text = run(gen, ChatRequest(Q, GREEDY))
    assert text["reasoning"] == "Six sevens." and text["content"] == "It is 42."
    assert "</think>" not in text["reasoning"] + text["content"]
    last = deltas[-1]
    assert last.finish_reason == "stop"
    n_reasoning = len(tok.encode("Six sevens.")) + 1  # the </think> token counts as reasoning
    assert last.usage.reasoning_tokens == n_reasoning and last.usage.completion_tokens == len(script)
    assert [d.kind for d in deltas][:2] == ["start", "reasoning"]


def test_think_close_split_across_tokens(tok, make):
    # "...</" + "think" + ">The": the tag spans three tokens; the last one also starts the content
    script = [124112, 37947, 62326, *tok.encode(" answer"), tok.eos_id]
    assert tok.decode(script[:3]) == "...</think>The"
    gen, _ = make(script)
    deltas, text = run(gen, ChatRequest(Q, GREEDY))
    assert (text["reasoning"], text["content"]) == ("...", "The answer")
    # nothing of the tag leaked into a streamed reasoning delta while it was still undecided
    assert all("<" not in d.text for d in deltas if d.kind == "reasoning")
    assert deltas[-1].usage.reasoning_tokens == 3


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_think_close_in_plain_text_pieces_any_chunking(tok, make, split):
    text = "Let me think.</think>Final."
    pieces = [text[i : i + split] for i in range(0, len(text), split)]
    script = [t for p in pieces for t in tok.backend.encode(p, add_special_tokens=False).ids] + [tok.eos_id]
    gen, _ = make(script)
    _, got = run(gen, ChatRequest(Q, GREEDY))
    assert (got["reasoning"], got["content"]) == ("Let me think.", "Final.")


def test_thinking_off_means_everything_is_content(tok, make):
    script = ids(tok, "plain answer ", tok.think_close_id, " tail", tok.eos_id)
    gen, _ = make(script)
    deltas, text = run(gen, ChatRequest(Q, GREEDY, chat=ChatOptions(thinking=False)))
    assert text["reasoning"] == "" and text["content"] == "plain answer </think> tail"
    assert deltas[-1].usage.reasoning_tokens == 0


def test_unclosed_reasoning_stays_reasoning(tok, make):
    gen, _ = make(ids(tok, "still thinking about it"))
    deltas, text = run(gen, ChatRequest(Q, GenerationOptions(temperature=0, max_tokens=3)))
    assert text["content"] == "" and text["reasoning"] == tok.decode(ids(tok, "still thinking about it")[:3])
    assert deltas[-1].finish_reason == "length"


def test_trailing_assistant_message_continues_in_content(tok, make):
    gen, _ = make(ids(tok, " more", tok.eos_id))
    msgs = [*Q, {"role": "assistant", "content": "The answer is", "reasoning_content": "easy"}]
    _, text = run(gen, ChatRequest(msgs, GREEDY))
    assert text == {"reasoning": "", "content": " more", "prompt": ""}


def test_stop_string_cancels_and_is_cut(tok, make):
    script = ids(tok, "a", tok.think_close_id, "one two STOP three four", tok.eos_id)
    gen, _ = make(script)
    opts = GenerationOptions(temperature=0, max_tokens=64, stop=("STOP",))
    deltas, text = run(gen, ChatRequest(Q, opts))
    assert text["content"] == "one two " and deltas[-1].finish_reason == "stop"
    assert deltas[-1].usage.completion_tokens < len(script)
    opts = GenerationOptions(temperature=0, max_tokens=64, stop=("STOP",), include_stop_str_in_output=True)
    _, text = run(gen, ChatRequest(Q, opts))
    assert text["content"] == "one two STOP"


def test_stop_token_ids_and_ignore_eos(tok, make):
    stop_id = tok.encode(" three")[0]
    script = ids(tok, "one two", " three", " four", tok.eos_id, " after")
    gen, _ = make(script)
    opts = GenerationOptions(temperature=0, max_tokens=64, stop_token_ids=(stop_id,))
    deltas, text = run(gen, CompletionRequest("x", opts))
    assert text["content"] == "one two" and deltas[-1].finish_reason == "stop"
    deltas, text = run(
        gen, CompletionRequest("x", GenerationOptions(temperature=0, max_tokens=len(script), ignore_eos=True))
    )
    assert text["content"].endswith(" four after") and deltas[-1].finish_reason == "length"


def test_chat_logprobs_follow_tokens(tok, make):
    script = ids(tok, "ab", tok.think_close_id, "Hello world", tok.eos_id)
    gen, _ = make(script)
    deltas, _ = run(gen, ChatRequest(Q, GenerationOptions(temperature=0, max_tokens=64, logprobs=2)))
    entries = [e for d in deltas for e in d.logprobs]
    rendered = script[:-1]  # EOS is counted, never rendered
    assert [e.token for e in entries] == [tok.decode([t]) for t in rendered]
    assert all(
        len(e.top) == 2 and e.top[0].token == e.token and e.logprob == pytest.approx(e.top[0].logprob) for e in entries
    )
    assert all(e.bytes == tuple(tok.token_bytes(t)) for e, t in zip(entries, rendered))


def test_completion_echo_with_prompt_logprobs(tok, make):
    gen, _ = make(ids(tok, " world", tok.eos_id))
    deltas, text = run(
        gen, CompletionRequest("Hello", GenerationOptions(temperature=0, max_tokens=4, logprobs=1), echo=True)
    )
    assert text["prompt"] == "Hello" and text["content"] == " world"
    body = render.full_completion(iter(deltas), render.Meta("m", "completion", logprobs=True))
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "Hello world"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # BOS has nothing before it
    assert lp["tokens"][:2] == ["<｜begin▁of▁sentence｜>", "Hello"] and lp["text_offset"][-1] == len("Hello")


def test_max_tokens_zero_with_echo_scores_the_prompt_only(tok, make):
    gen, _ = make(ids(tok, " x"))
    deltas, text = run(gen, CompletionRequest("Hi there", GenerationOptions(max_tokens=0, logprobs=0), echo=True))
    assert text["prompt"] == "Hi there" and text["content"] == ""
    assert deltas[-1].usage.completion_tokens == 0 and deltas[-1].finish_reason == "length"


def test_tool_call_is_parsed_and_finishes_with_tool_calls(tok, make):
    call = (
        '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="add">\n<｜DSML｜ parameter name="a" string="false">6'
        "</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )
    script = ids(tok, "use the tool", tok.think_close_id, call, tok.eos_id)
    gen, _ = make(script)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    deltas, text = run(gen, ChatRequest(Q, GREEDY, tools=tools))
    calls = [d.tool_call for d in deltas if d.kind == "tool_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 6})]
    assert deltas[-1].finish_reason == "tool_calls" and text["content"].strip() == ""
    _, text = run(gen, ChatRequest(Q, GREEDY, tools=tools, tool_choice="none"))
    assert "invoke" in text["content"]


def test_expert_counters_become_per_request_numbers(tok, make):
    gen, runner = make(ids(tok, "a b c", tok.eos_id))
    stream = gen.open_completion(CompletionRequest("x", GREEDY))
    list(stream)
    s = stream.stats
    assert s.experts.hits == 3 * s.completion_tokens and s.experts.misses == s.completion_tokens
    assert s.hit_rate == pytest.approx(0.75) and s.ttft_s is not None
    assert s.experts.bytes_streamed == 1000 * s.completion_tokens


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_stream_and_full_renderings_agree(tok, make, endpoint):
    script = ids(tok, "think", tok.think_close_id, "Hello there, friend", tok.eos_id)
    gen, _ = make(script)
    opts = GenerationOptions(temperature=0, max_tokens=64, logprobs=1)
    req = ChatRequest(Q, opts) if endpoint == "chat" else CompletionRequest("x", opts)
    meta = render.Meta("m", endpoint, logprobs=True, include_usage=True)
    if endpoint == "chat":
        chunks = list(render.stream_chat(gen.stream(req), meta))
        full = render.full_chat(gen.stream(req), meta)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
        assert (text, reasoning) == (
            full["choices"][0]["message"]["content"],
            full["choices"][0]["message"]["reasoning_content"],
        )
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        n_lp = sum(len((c["choices"][0]["logprobs"] or {"content": []})["content"]) for c in chunks if c["choices"])
        assert n_lp == len(full["choices"][0]["logprobs"]["content"]) == len(script) - 1
    else:
        chunks = list(render.stream_completion(gen.stream(req), meta))
        full = render.full_completion(gen.stream(req), meta)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == full["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert chunks[-2]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"] == "stop"


def test_a_failing_request_does_not_stop_the_engine(tok, make):
    gen, runner = make(ids(tok, "fine", tok.eos_id))
    real = runner.forward
    calls = {"n": 0}

    def flaky(tokens, start_pos, all_logits):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(tokens, start_pos, all_logits)

    runner.forward = flaky
    with pytest.raises(RuntimeError, match="boom"):
        list(gen.stream(CompletionRequest("x", GREEDY)))
    _, text = run(gen, CompletionRequest("x", GREEDY))
    assert text["content"] == "fine"


def test_tiny_temperatures_sample_greedily(tok, make):
    gen, _ = make(ids(tok, "same answer", tok.eos_id))
    opts = GenerationOptions(temperature=5e-324, max_tokens=8, seed=3)
    _, text = run(gen, CompletionRequest("x", opts))
    assert text["content"] == "same answer"


@pytest.mark.parametrize("top_p", [1e-300, 1e-323])
def test_vanishing_top_p_keeps_the_best_token(tok, make, top_p):
    gen, _ = make(ids(tok, "same answer", tok.eos_id))
    _, text = run(gen, CompletionRequest("x", GenerationOptions(temperature=1.0, top_p=top_p, max_tokens=8, seed=3)))
    assert text["content"] == "same answer"


def test_a_request_cancelled_while_queued_leaves_the_queue_at_once(tok):
    runner = ScriptedRunner([5] * 500, tok.vocab_size, eos=tok.eos_id, step_s=0.01)
    engine = Engine(runner, tok.eos_ids, max_queue=1).start()
    try:
        gen = Generator(engine, tok, 4096)
        long = GenerationOptions(temperature=0, max_tokens=400, ignore_eos=True)
        running = gen.open_completion(CompletionRequest("x", long))
        running.handle.started.wait(5)
        waiting = gen.open_completion(CompletionRequest("y", long))
        assert engine.queue.depth == 1
        waiting.cancel()
        assert engine.queue.depth == 0 and [d.finish_reason for d in waiting][-1] == "cancelled"
        assert not running.handle.cancelled  # the running request is untouched
        running.cancel()
        assert list(running)[-1].finish_reason == "cancelled"
    finally:
        engine.close()


def test_the_context_is_checked_once_here_with_the_templated_prompt(tok, make):
    gen, _ = make([5], max_len=64)
    n = len(gen.text_prompt("Hello"))
    with pytest.raises(ContextTooLong) as e:
        gen.open_completion(CompletionRequest("Hello", GenerationOptions(max_tokens=65 - n)))
    assert e.value.param == "max_tokens"
    assert str(e.value) == f"this model's context is 64 tokens; the prompt has {n} and max_tokens is {65 - n} " + (
        f"(at most {64 - n} fit)"
    )
    with pytest.raises(ContextTooLong) as e:  # far beyond the context: the same check, the same answer
        gen.open_chat(ChatRequest(Q, GenerationOptions(max_tokens=1 << 40)))
    assert e.value.param == "max_tokens"
    with pytest.raises(ContextTooLong) as e:
        gen.open_completion(CompletionRequest(tuple([5] * 64)))
    assert e.value.param == "prompt" and str(e.value) == "the prompt is 64 tokens; this model's context is 64 tokens"
    assert list(gen.stream(CompletionRequest("Hello", GenerationOptions(max_tokens=64 - n))))[-1].finish_reason


def test_a_request_without_max_tokens_gets_the_server_default_and_none_passes_the_limit(tok):
    """A request that names no max_tokens stops at the server's default (or where the context ends, if sooner); one
    that asks for more than the server's limit is a 400 naming the limit."""
    runner = ScriptedRunner([5] * 200, tok.vocab_size, eos=tok.eos_id, max_len=4096)
    engine = Engine(runner, tok.eos_ids, max_queue=4).start()
    try:
        gen = Generator(engine, tok, 4096, max_tokens_default=7, max_tokens_limit=9)
        for req in (ChatRequest(Q, GenerationOptions(temperature=0)), CompletionRequest("x", GenerationOptions())):
            deltas = list(gen.stream(req))
            assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 7
        deltas = list(gen.stream(ChatRequest(Q, GenerationOptions(temperature=0, max_tokens=9))))
        assert deltas[-1].usage.completion_tokens == 9
        with pytest.raises(InvalidRequest, match="max_tokens is 10; this server allows at most 9 a request") as e:
            gen.open_chat(ChatRequest(Q, GenerationOptions(max_tokens=10)))
        assert e.value.param == "max_tokens"
        short = Generator(engine, tok, 40, max_tokens_default=7)  # the context ends first
        n = len(short.text_prompt("x"))
        assert list(short.stream(CompletionRequest("x", GenerationOptions())))[-1].usage.completion_tokens == min(
            7, 40 - n
        )
    finally:
        engine.close()


def test_admission_and_gauges(tok):
    runner = ScriptedRunner([5] * 500, tok.vocab_size, eos=tok.eos_id, step_s=0.01)
    engine = Engine(runner, tok.eos_ids, max_queue=1)
    gen = Generator(engine, tok, 4096)
    with pytest.raises(NotReady):
        gen.check_admission()
    engine.start()
    try:
        assert gen.gauges() == {"queue_depth": 0, "requests_running": 0}
        long = GenerationOptions(temperature=0, max_tokens=400, ignore_eos=True)
        running = gen.open_completion(CompletionRequest("x", long))
        running.handle.started.wait(5)
        assert running.started
        gen.check_admission()  # room for one waiting
        waiting = gen.open_completion(CompletionRequest("y", long))
        assert gen.gauges() == {"queue_depth": 1, "requests_running": 1} and not waiting.started
        with pytest.raises(Overloaded) as e:
            gen.check_admission()
        assert e.value.retry_after == 1 and str(e.value) == "the request queue is full (1 waiting)"
        waiting.cancel()
        running.cancel()
        list(running)
    finally:
        engine.close()
    with pytest.raises(EngineDead):
        gen.check_admission()


def test_min_tokens_holds_back_eos_and_stop_token_ids(tok, make):
    """vLLM's min_tokens: EOS and stop_token_ids are not sampled until that many tokens are out (the runner-up
    comes instead); after that they stop the output as usual."""
    a, b, stop = tok.encode(" one")[0], tok.encode(" two")[0], tok.encode(" three")[0]
    gen, _ = make([a, tok.eos_id, b, tok.eos_id])
    plain = list(gen.stream(CompletionRequest("x", GenerationOptions(temperature=0, max_tokens=8))))
    assert plain[-1].usage.completion_tokens == 2 and plain[-1].finish_reason == "stop"
    held = list(gen.stream(CompletionRequest("x", GenerationOptions(temperature=0, max_tokens=8, min_tokens=3))))
    assert held[-1].usage.completion_tokens == 4 and held[-1].finish_reason == "stop"
    gen, _ = make([a, stop, b, tok.eos_id])
    opts = GenerationOptions(temperature=0, max_tokens=8, stop_token_ids=(stop,), min_tokens=2)
    deltas, text = run(gen, CompletionRequest("x", opts))
    assert deltas[-1].usage.completion_tokens == 4 and text["content"].endswith(" two")
    assert tok.decode([stop + 1]) in text["content"]  # the runner-up took the held-back stop id's place


def test_prompt_logprobs_per_position(tok, make):
    """vLLM's prompt_logprobs: None for the first prompt token, then the prompt's token and the top k."""
    first = tok.encode(" world")[0]
    gen, _ = make([first, tok.eos_id])
    req = CompletionRequest("Hello there", GenerationOptions(temperature=0, max_tokens=4, prompt_logprobs=1))
    deltas = list(gen.stream(req))
    prompt = gen.text_prompt("Hello there")
    positions = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None)
    assert len(positions) == len(prompt) and positions[0] is None
    for token, entries in zip(prompt[1:], positions[1:]):
        assert entries[0].token_id == token and entries[0].token == tok.decode([token])
        assert entries[-1].token_id == first and entries[-1].rank == 1  # the scripted runner's favourite
    body = render.full_completion(iter(deltas), render.Meta("m", "completion", prompt_logprobs=True))
    assert body["choices"][0]["prompt_logprobs"][1][str(first)]["rank"] == 1
    chat = list(gen.stream(ChatRequest(Q, GenerationOptions(temperature=0, max_tokens=4, prompt_logprobs=0))))
    positions = next(d.prompt_logprobs for d in chat if d.prompt_logprobs is not None)
    assert len(positions) == len(gen.chat_prompt(ChatRequest(Q))) and all(len(p) == 1 for p in positions[1:])


def test_retry_after_is_the_queues_expected_wait(tok):
    """Retry-After: the requests ahead (waiting and running) times the recent mean engine time per request, at least
    1 s and at most 60 s; with no history yet, 1 s."""
    runner = ScriptedRunner([5] * 500, tok.vocab_size, eos=tok.eos_id, step_s=0.01)
    engine = Engine(runner, tok.eos_ids, max_queue=1).start()
    gen = Generator(engine, tok, 4096)
    try:
        list(gen.stream(CompletionRequest("x", GenerationOptions(temperature=0, max_tokens=30, ignore_eos=True))))
        assert 0.25 < gen.recent_s[-1] < 3  # 30 steps of 10 ms, measured, not assumed
        long = GenerationOptions(temperature=0, max_tokens=400, ignore_eos=True)
        running = gen.open_completion(CompletionRequest("x", long))
        running.handle.started.wait(5)
        waiting = gen.open_completion(CompletionRequest("y", long))
        gen.recent_s.clear()
        gen.recent_s.extend([2.0, 4.0])  # a mean of 3 s; two requests ahead
        with pytest.raises(Overloaded) as e:
            gen.check_admission()
        assert e.value.retry_after == 6
        gen.recent_s.extend([100.0] * 16)
        with pytest.raises(Overloaded) as e:
            gen.check_admission()
        assert e.value.retry_after == 60
        gen.recent_s.clear()
        gen.recent_s.append(0.01)
        with pytest.raises(Overloaded) as e:
            gen.check_admission()
        assert e.value.retry_after == 1
        waiting.cancel()
        running.cancel()
        list(running)
    finally:
        engine.close()
