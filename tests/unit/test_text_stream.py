"""The stream side of text/: detokenizer, stop strings, reasoning split and DSML tool calls, fed piece by piece."""

import json
import random

import pytest

from dsflash.text.detokenizer import Detokenizer, token_text
from dsflash.text.reasoning import ReasoningParser, split_reasoning
from dsflash.text.stops import StopMatcher, partial_suffix_len
from dsflash.text.tokenizer import Tokenizer
from dsflash.text.tools import ToolCall, ToolCallParser, render_tool_calls

EOS = "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.bundled("v4")


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# ---- detokenizer --------------------------------------------------------------------------------------------------

TEXTS = [
    "Hello, world!",
    "数学很有趣🙂🙂 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<think>r</think>ok\n\n<｜DSML｜ calls>",
    "e\u0301 ∑ x² — “quotes”",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_full_decode_and_never_hold_replacement_chars(tok, text):
    ids = tok.encode(text) + [tok.eos_id]
    detok = Detokenizer(tok)
    pieces = detok.feed_many(ids)
    assert "".join(p.text for p in pieces) + detok.finish() == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in p.text for p in pieces)
    assert detok.text == text


def test_a_split_character_is_released_whole_by_the_token_that_completes_it(tok):
    ids = tok.encode("数🙂")
    detok = Detokenizer(tok)
    pieces = detok.feed_many(ids)
    partial = [p for p in pieces if p.text == ""]
    assert partial, "the emoji should span several byte tokens"
    assert pieces[-1].text.endswith("🙂")
    assert b"".join(p.token_bytes for p in pieces) == "数🙂".encode()


def test_offsets_locate_each_piece_in_the_text(tok):
    text = "数学🙂 ok <think>x</think>"
    detok = Detokenizer(tok)
    pieces = detok.feed_many(tok.encode(text))
    assert [p.offset for p in pieces] == sorted(p.offset for p in pieces)
    for p in pieces:
        assert text[p.offset : p.offset + len(p.text)] == p.text


def test_unfinished_character_at_the_end_becomes_one_replacement(tok):
    ids = tok.encode("🙂")
    detok = Detokenizer(tok)
    assert "".join(p.text for p in detok.feed_many(ids[:-1])) == ""
    assert detok.pending_bytes != b""
    assert detok.finish() == "\ufffd"


def test_specials_are_skipped_but_markup_is_kept(tok):
    ids = [tok.bos_id, tok.think_close_id, tok.token_to_id("｜DSML｜"), tok.eos_id]
    assert "".join(p.text for p in Detokenizer(tok).feed_many(ids)) == "</think>｜DSML｜"
    keep_all = Detokenizer(tok, skip_special_tokens=False)
    assert "".join(p.text for p in keep_all.feed_many(ids)) == "<｜begin▁of▁sentence｜></think>｜DSML｜" + EOS


def test_token_text_for_logprobs(tok):
    ids = tok.encode("a🙂")
    assert token_text(tok, ids[0]) == "a"
    assert token_text(tok, ids[-1]).startswith("bytes:\\x")


# ---- stop strings -------------------------------------------------------------------------------------------------


def run_stops(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.finish()


def test_stop_truncates_before_the_match():
    m = StopMatcher(["STOP"])
    assert run_stops(m, ["Hello ST", "OP and more"]) == "Hello "
    assert m.stopped and m.matched == "STOP"
    assert m.feed("late") == ""


def test_partial_match_is_held_then_released():
    m = StopMatcher(["</end>"])
    assert m.feed("a </e") == "a "
    assert m.held == "</e"
    assert m.feed("xtra") == "</extra"
    assert m.finish() == "" and not m.stopped


def test_held_text_is_released_at_the_end():
    m = StopMatcher(["abc"])
    assert m.feed("xxab") == "xx"
    assert m.finish() == "ab"


def test_include_stop_string_in_output():
    assert run_stops(StopMatcher(["\n\n"], include_stop_str_in_output=True), ["one\n", "\ntwo"]) == "one\n\n"


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["world", "lo w", "x"])
    assert run_stops(m, ["hel", "lo", " wor", "ld"]) == "hel"
    assert m.matched == "lo w"


def test_no_stops_passes_everything_through():
    m = StopMatcher(["", ""])
    assert run_stops(m, ["a", "b"]) == "ab"


@pytest.mark.parametrize("seed", range(20))
def test_stop_result_does_not_depend_on_chunking(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab<>/\n") for _ in range(60))
    stops = ["<//", "ba\n", "aaa"]
    whole = run_stops(StopMatcher(stops), [text])
    assert run_stops(StopMatcher(stops), random_chunks(text, rng)) == whole
    assert run_stops(StopMatcher(stops), list(text)) == whole
    first = min((text.find(s) for s in stops if s in text), default=len(text))
    assert whole == text[:first]


def test_partial_suffix_len():
    assert partial_suffix_len("abc</th", ["</think>"]) == 4
    assert partial_suffix_len("abc</think>", ["</think>"]) == 0  # a whole match is not partial
    assert partial_suffix_len("x\n", ["\n\n<a>", "<a>"]) == 1


# ---- reasoning ------------------------------------------------------------------------------------------------------


def run_reasoning(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    segs = [s for p in pieces for s in parser.feed(p)] + parser.finish()
    return "".join(s.text for s in segs if s.kind == "reasoning"), "".join(s.text for s in segs if s.kind == "content")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 100])
def test_reasoning_ends_at_close_tag_at_any_chunking(size):
    text = "Let me think </th> about it.</think>The answer is 4."
    assert run_reasoning(ReasoningParser(True), chunks(text, size)) == (
        "Let me think </th> about it.",
        "The answer is 4.",
    )


def test_close_tag_split_inside_one_chunk_and_across_chunks():
    p = ReasoningParser(True)
    assert p.feed("abc</thi") == [("reasoning", "abc")]
    assert p.feed("nk>de") == [("content", "de")]
    assert not p.in_reasoning
    assert run_reasoning(ReasoningParser(True), ["x</think>y"]) == ("x", "y")


def test_model_that_writes_its_own_open_tag():
    assert run_reasoning(ReasoningParser(True), ["<th", "ink>", "plan</think>go"]) == ("plan", "go")
    assert run_reasoning(ReasoningParser(True), ["\n<think>plan</think>go"]) == ("plan", "go")


def test_non_thinking_mode_is_all_content():
    assert run_reasoning(ReasoningParser(False), ["<think>a</think>b"]) == ("", "<think>a</think>b")


def test_unclosed_reasoning_stays_reasoning():
    assert run_reasoning(ReasoningParser(True), ["still </thi"]) == ("still </thi", "")


def test_tool_block_without_close_tag_ends_the_reasoning():
    text = "I will call it\n\n<｜DSML｜ calls>\n"
    assert run_reasoning(ReasoningParser(True), chunks(text, 3)) == ("I will call it", "\n\n<｜DSML｜ calls>\n")


def test_close_tag_arriving_as_a_special_token_id(tok):
    ids = tok.encode("plan") + [tok.think_close_id] + tok.encode("answer")
    detok, parser = Detokenizer(tok), ReasoningParser(True)
    segs = [s for i in ids for s in parser.feed(detok.feed(i).text)] + parser.finish()
    assert [tuple(s) for s in segs] == [("reasoning", "plan"), ("content", "answer")]
    assert split_reasoning("plan</think>answer") == ("plan", "answer")


# ---- DSML tool calls ----------------------------------------------------------------------------------------------

ARGS = {"query": '{"a": 1}', "limit": 2, "flags": [1, True, None], "nested": {"k": "v"}, "ok": False, "none": None}


def run_tools(pieces: list[str], **kwargs) -> tuple[str, list[ToolCall]]:
    parser = ToolCallParser(**kwargs)
    items = [x for p in pieces for x in parser.feed(p)] + parser.finish()
    return "".join(x for x in items if isinstance(x, str)), [x for x in items if isinstance(x, ToolCall)]


@pytest.mark.parametrize("release", ["v4", "v41"])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 23, 1000])
def test_rendered_calls_parse_back_at_every_chunk_size(release, size):
    text = "summary" + render_tool_calls([("lookup", ARGS), ("get_weather", {"city": "Paris"})], release)
    content, calls = run_tools(chunks(text, size))
    assert content == "summary"
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "lookup", ARGS),
        (1, "get_weather", {"city": "Paris"}),
    ]


def test_string_flag_semantics():
    text = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="s" string="true">42</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="n" string="false">42</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="bad" string="false">not json</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="multi" string="true">line 1\n"line" 2</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )
    _, [call] = run_tools([text])
    assert json.loads(call.arguments) == {"s": "42", "n": 42, "bad": "not json", "multi": 'line 1\n"line" 2'}


def test_call_ids_and_openai_shapes():
    ids = iter(["call_a", "call_b"])
    text = render_tool_calls([("f", {}), ("g", {"x": 1})], "v41")
    _, calls = run_tools([text], new_id=lambda: next(ids))
    assert [c.to_delta() for c in calls] == [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
    ]
    _, more = run_tools([text])
    assert more[0].id.startswith("call_") and more[0].id != more[1].id


def test_text_that_only_looks_like_a_block_start_is_released():
    parser = ToolCallParser()
    assert parser.feed("a\n") == ["a"]
    assert parser.feed("\n<｜DSML") == []
    assert parser.feed("｜ bold") == ["\n\n<｜DSML｜ bold"]
    assert parser.finish() == []


def test_content_around_a_block_and_older_block_names():
    block = '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'
    text = "before\n\n" + block + "\nafter"
    content, calls = run_tools(chunks(text, 4))
    assert content == "before\nafter" and [c.name for c in calls] == ["f"]


def test_long_value_fed_one_character_at_a_time():
    value = "line </｜DSML｜ param\n" * 2000  # near-misses of the closer inside the value
    content, [call] = run_tools(list("ok" + render_tool_calls([("write", {"body": value, "n": 1})], "v41")))
    assert content == "ok" and json.loads(call.arguments) == {"body": value, "n": 1}


def test_block_without_closer_at_end_of_stream_keeps_its_calls():
    text = '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>\n</｜DSML｜ cal'
    assert run_tools(chunks(text, 5))[0] == ""
    assert [c.name for c in run_tools(chunks(text, 5))[1]] == ["f"]
    cut_invoke = text[: text.rindex("</｜DSML｜ cal")] + '<｜DSML｜ invoke name="g'
    assert run_tools(chunks(cut_invoke, 5))[0] == '\n<｜DSML｜ invoke name="g'


@pytest.mark.parametrize(
    "block",
    [
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\nhello\n</｜DSML｜ invoke>\n</｜DSML｜ calls>',  # junk in invoke
        "<｜DSML｜ calls>\nfree text\n</｜DSML｜ calls>",  # junk between invokes
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="x" string="true">cut off',  # truncated
        '<｜DSML｜ calls>\n<｜DSML｜ invoke nam="f">\n</｜DSML｜ invoke>',  # bad attribute
        "<｜DSML｜ calls>",  # opener only
        "<｜DSML｜ calls>\n</｜DSML｜ calls>",  # empty block
    ],
)
def test_malformed_blocks_degrade_to_content(block):
    for size in (1, 3, 1000):
        content, calls = run_tools(chunks("x" + block, size))
        assert calls == [] and content == "x" + block


def test_malformed_second_call_keeps_the_first():
    first = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>\n'
    content, calls = run_tools([first + "garbage</｜DSML｜ calls>"])
    assert [c.name for c in calls] == ["f"] and content == "\ngarbage</｜DSML｜ calls>"


@pytest.mark.parametrize("seed", range(100))
def test_parser_never_raises_on_noise(seed):
    rng = random.Random(seed)
    atoms = ["<｜DSML｜", " calls>", "tool_calls>", " invoke", ' name="f"', ">", "</", " parameter", ' string="false"',
             "\n", "x", "{", "</｜DSML｜ parameter>", "</｜DSML｜ invoke>", "</｜DSML｜ calls>"]  # fmt: skip
    text = "".join(rng.choice(atoms) for _ in range(40))
    content, calls = run_tools(random_chunks(text, rng), new_id=lambda: "id")
    assert (content, calls) == run_tools([text], new_id=lambda: "id")  # chunking never changes the outcome
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)
    if not calls:
        assert content.replace("\n", "") == text.replace("\n", "")


def test_full_stream_pipeline_from_token_ids(tok):
    """detokenizer -> reasoning -> tools -> stops, one token at a time, as the server drives them."""
    completion = "Check the weather.</think>Sure." + render_tool_calls([("get", {"city": "Oslo", "days": 3})], "v4")
    ids = tok.encode(completion) + [tok.eos_id]
    detok, reasoning, tools, stops = Detokenizer(tok), ReasoningParser(True), ToolCallParser(), StopMatcher(["NEVER"])
    got_reasoning, got_content, got_calls = "", "", []
    for i in ids:
        for seg in reasoning.feed(detok.feed(i).text):
            if seg.kind == "reasoning":
                got_reasoning += seg.text
                continue
            for item in tools.feed(seg.text):
                if isinstance(item, ToolCall):
                    got_calls.append(item)
                else:
                    got_content += stops.feed(item)
    for seg in reasoning.finish():
        got_reasoning += seg.text if seg.kind == "reasoning" else ""
    got_content += "".join(x for x in tools.finish() if isinstance(x, str)) + stops.finish()
    assert (got_reasoning, got_content) == ("Check the weather.", "Sure.")
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == [("get", {"city": "Oslo", "days": 3})]
