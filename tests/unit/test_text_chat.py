"""text/chat.py: DeepSeek V4 / V4.1 prompt encoding (golden cases restated as data), OpenAI mapping, parsing back."""

import json
from pathlib import Path

import pytest

from dsflash.errors import ContextTooLong, InvalidRequest, UnsupportedInput
from dsflash.text.chat import (
    ChatOptions,
    chat_options,
    encode_chat,
    openai_to_native,
    parse_completion,
    render_chat,
    render_messages,
)
from dsflash.text.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "text"
BOS, EOS, SYS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜System｜>"
EFFORT = SYS + "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
V4_MAX = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"

# Golden cases: DeepSeek-V4-Flash `encoding/tests` (V4) and the V4.1 release's encoder cases (as vendored in SGLang's
# fixtures); mode per case as their harnesses use it. Case-level tools attach to messages[0].
GOLDEN = [("dsv4", "v4", i, m) for i, m in enumerate(["thinking", "thinking", "thinking", "chat"], 1)]
GOLDEN += [("dsv41", "v41", i, "chat") for i in range(1, 6)]


def _case(folder: str, i: int, mode: str):
    data = json.loads((DATA / folder / f"case_{i}.json").read_text(encoding="utf-8"))
    data = {"messages": data} if isinstance(data, list) else data
    if "tools" in data:
        data["messages"][0]["tools"] = data["tools"]
    gold = (DATA / folder / f"case_{i}.txt").read_text(encoding="utf-8")
    return data["messages"], data.get("thinking_mode", mode) == "thinking", data.get("reasoning_effort"), gold


@pytest.mark.parametrize("folder,release,i,mode", GOLDEN, ids=[f"{g[1]}-case{g[2]}" for g in GOLDEN])
def test_golden_prompts_byte_exact(folder, release, i, mode):
    messages, thinking, effort, gold = _case(folder, i, mode)
    assert render_messages(messages, release=release, thinking=thinking, reasoning_effort=effort) == gold


def test_v4_case1_parse_both_assistant_turns():
    messages, _, _, prompt = _case("dsv4", 1, "thinking")
    marker = "<｜Assistant｜><think>"
    first = prompt.find(marker) + len(marker)
    call_turn = parse_completion(prompt[first : prompt.find("<｜User｜>", first)])
    assert call_turn.reasoning == "The user wants to know the weather in Beijing. I should use the get_weather tool."
    assert call_turn.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in call_turn.tool_calls] == [
        ("get_weather", {"location": "Beijing", "unit": "celsius"})
    ]
    final = parse_completion(prompt[prompt.rfind(marker) + len(marker) :])
    assert final.reasoning == "Got the weather data. Let me format a nice response."
    assert "22°C" in final.content and final.tool_calls == []


def test_v4_case2_drops_earlier_reasoning_and_parses_last_turn():
    _, _, _, prompt = _case("dsv4", 2, "thinking")
    assert "The user said hello" not in prompt
    last = parse_completion(prompt[prompt.rfind("<think>") + len("<think>") :])
    assert (last.reasoning, last.content) == (
        "The user asks about the capital of France. It is Paris.",
        "The capital of France is Paris.",
    )


# ---- V4.1 behaviours (restated from the V4.1 encoder's unit tests) -------------------------------------------------

Q = [{"role": "user", "content": "question"}]


@pytest.mark.parametrize(
    "effort,budget",
    [(None, 50), ("low", 25), ("high", 50), ("xhigh", 75), ("max", 100), (1, 1), (42, 42), (100, 100), ("medium", 50)],
)
def test_v41_effort_levels(effort, budget):
    got = render_messages(Q, release="v41", thinking=True, reasoning_effort=effort)
    assert got == BOS + EFFORT.format(budget) + "<｜User｜>question<｜Assistant｜><think>"


@pytest.mark.parametrize("effort", [-1, 0, 101, "none", "minimal", True, False, 1.5])
def test_v41_rejects_unknown_efforts_even_in_chat_mode(effort):
    for thinking in (True, False):
        with pytest.raises(InvalidRequest) as e:
            render_messages(Q, release="v41", thinking=thinking, reasoning_effort=effort)
        assert e.value.param == "reasoning_effort"


def test_v41_chat_mode_has_no_effort_and_no_system_token():
    assert (
        render_messages([{"role": "user", "content": "hello"}], release="v41", thinking=False, reasoning_effort="max")
        == BOS + "<｜User｜>hello<｜Assistant｜></think>"
    )


def test_v41_system_token_rules():
    sys_hi = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "hello"}]
    assert render_messages(sys_hi, release="v41", thinking=False) == (
        BOS + SYS + "You are a helpful assistant.<｜User｜>hello<｜Assistant｜></think>"
    )
    empty, bare = (
        [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}],
    )
    assert render_messages(empty, thinking=False) == BOS + SYS + render_messages(bare, thinking=False)[len(BOS) :]
    assert render_messages(empty, thinking=True) == render_messages(bare, thinking=True)


def test_v41_mid_conversation_system_opens_the_assistant_turn():
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "system", "content": "mid sys"},
    ]
    assert render_messages(msgs, release="v41", thinking=True, reasoning_effort=88) == (
        BOS
        + EFFORT.format(88)
        + "sys<｜User｜>q1<｜Assistant｜></think>a1"
        + EOS
        + SYS
        + "mid sys<｜Assistant｜><think>"
    )


V41_CALL = (
    "  reason  </think>summary\n\n<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="lookup">\n'
    '<｜DSML｜ parameter name="query" string="true">value</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="limit" string="false">2</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>" + EOS
)
CALL_TURN = [
    {"role": "user", "content": "question"},
    {
        "role": "assistant",
        "reasoning_content": "  reason  ",
        "content": "summary",
        "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": '{"query":"value","limit":2}'}}
        ],
    },
]


def test_v41_tools_prompt_uses_spaced_tags():
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    got = render_messages([{"role": "system", "content": "s", "tools": [tool]}, *Q], release="v41", thinking=False)
    assert (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="$TOOL_NAME">\n<｜DSML｜ parameter name="$PARAMETER_NAME" '
        'string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>\n...\n</｜DSML｜ invoke>' in got
    )
    assert not any(t in got for t in ("<｜DSML｜tool_calls>", "<｜DSML｜invoke", "<｜DSML｜parameter"))


def test_v41_assistant_call_renders_and_parses_back():
    prompt = render_messages(CALL_TURN, release="v41", thinking=True)
    assert prompt == BOS + EFFORT.format(50) + "<｜User｜>question<｜Assistant｜><think>" + V41_CALL
    parsed = parse_completion(V41_CALL)
    assert (parsed.reasoning, parsed.content) == ("  reason  ", "summary")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("lookup", {"query": "value", "limit": 2})
    ]
    again = render_messages([CALL_TURN[0], parsed.to_message()], release="v41", thinking=True)
    assert again == prompt


def test_v4_syntax_is_still_read_as_a_call():
    # Deliberate deviation: the reference V4.1 parser rejects V4 tags; we read them, since leaking a well-formed call
    # into content is worse than accepting the older spelling.
    v4_text = V41_CALL.replace("｜DSML｜ calls", "｜DSML｜tool_calls").replace("｜DSML｜ ", "｜DSML｜")
    parsed = parse_completion(v4_text)
    assert parsed.content == "summary" and parsed.tool_calls[0].name == "lookup"


def test_non_object_tool_arguments_are_rejected():
    bad = json.loads(json.dumps(CALL_TURN))
    bad[1]["tool_calls"][0]["function"]["arguments"] = '"scalar"'
    with pytest.raises(InvalidRequest, match="JSON object"):
        render_messages(bad, thinking=False)
    with pytest.raises(InvalidRequest) as e:
        render_chat(bad, options=ChatOptions(thinking=False))
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


def test_drop_thinking_without_tools():
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    got = render_messages(msgs, release="v41", thinking=True)
    assert "<｜User｜>q1<｜Assistant｜></think>a1" + EOS in got
    assert "r1" not in got and got.endswith("<｜User｜>q2<｜Assistant｜><think>")
    kept = render_messages(msgs, release="v41", thinking=True, drop_thinking=False)
    assert "<｜User｜>q1<｜Assistant｜><think>r1</think>a1" + EOS in kept


def test_task_token_after_user_content():
    got = render_messages([{"role": "user", "content": "classify me", "task": "query"}], thinking=False)
    assert got.endswith("classify me<｜query｜>") and "<｜Assistant｜>" not in got


def test_image_blocks_become_placeholders_in_order():
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "inspect"}, {"type": "image_url", "image_url": {"url": "/a.png"}},
        {"type": "text", "text": "and"}, {"type": "image_url", "image_url": "/b.png"},
    ]}]  # fmt: skip
    img = "<｜deepseek_image｜>"
    expected = BOS + f"<｜User｜>inspect\n\n{img}\n\nand\n\n{img}<｜Assistant｜></think>"
    assert render_messages(msgs, release="v41", thinking=False) == expected
    assert render_chat(msgs, options=ChatOptions(thinking=False), allow_images=True) == expected


def test_literal_image_placeholder_in_text_is_escaped_not_rejected():
    # Deliberate deviation: the reference raises; a 400 here leaves clients that resend history stuck.
    got = render_messages([{"role": "user", "content": "hi <｜deepseek_image｜>"}], release="v41", thinking=False)
    assert "<｜deepseek_image｜>" not in got and "hi <|deepseek_image|>" in got


@pytest.mark.parametrize(
    "msgs",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "1+1=?"}, {"role": "assistant", "content": "2", "reasoning_content": "r"},
         {"role": "user", "content": "2+2=?"}],
    ],
)  # fmt: skip
def test_plain_chat_is_identical_in_v4_and_v41(msgs):
    assert render_messages(msgs, release="v41", thinking=False) == render_messages(msgs, release="v4", thinking=False)


# ---- V4 specifics -----------------------------------------------------------------------------------------------


def test_v4_effort_max_paragraph_only_in_thinking_mode():
    assert render_messages(Q, release="v4", thinking=True, reasoning_effort="max").startswith(BOS + V4_MAX)
    assert render_messages(Q, release="v4", thinking=True, reasoning_effort="xhigh").startswith(BOS + V4_MAX)
    assert V4_MAX not in render_messages(Q, release="v4", thinking=False, reasoning_effort="max")
    assert render_messages(Q, release="v4", thinking=True, reasoning_effort="low") == (
        BOS + "<｜User｜>question<｜Assistant｜><think>"
    )
    with pytest.raises(InvalidRequest):
        render_messages(Q, release="v4", thinking=True, reasoning_effort=50)


def test_v4_chat_example_from_the_spec():
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "Bye"},
    ]
    assert render_messages(msgs, release="v4", thinking=False) == (
        BOS + "You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there!" + EOS
        + "<｜User｜>Bye<｜Assistant｜></think>"
    )  # fmt: skip


# ---- OpenAI requests -------------------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "get", "description": "d", "parameters": {"type": "object"}}}


def test_request_tools_go_on_the_system_message_or_a_new_empty_one():
    with_sys = render_chat([{"role": "system", "content": "S"}, *Q], [TOOL], release="v4",
                           options=ChatOptions(thinking=False))  # fmt: skip
    assert with_sys.startswith(BOS + "S\n\n## Tools\n\n")
    without = render_chat(Q, [TOOL], release="v4", options=ChatOptions(thinking=False))
    assert without.startswith(BOS + "\n\n## Tools\n\n")
    v41 = render_chat(Q, [TOOL], release="v41", options=ChatOptions(thinking=False))
    assert v41.startswith(BOS + SYS + "\n\n## Tools\n\n")
    assert render_chat(Q, [], options=ChatOptions(thinking=False)) == BOS + "<｜User｜>question<｜Assistant｜></think>"


def test_openai_developer_role_is_system_and_parts_are_joined():
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
            {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]  # fmt: skip
    assert render_chat(msgs, options=ChatOptions(thinking=False)) == (
        BOS + SYS + "A\n\nB<｜User｜>x\n\ny<｜Assistant｜></think>"
    )


def test_tool_results_merge_into_one_user_turn_in_call_order():
    msgs = [
        {"role": "user", "content": "weather in A and B?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "A"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get", "arguments": {"city": "B"}}},
        ]},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sun"}]},
    ]  # fmt: skip
    got = render_chat(msgs, [TOOL], release="v41", options=ChatOptions(thinking=False))
    assert got.endswith(
        "<｜User｜><tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result><｜Assistant｜></think>"
    )
    assert '<｜DSML｜ parameter name="city" string="true">A</｜DSML｜ parameter>' in got


def test_reasoning_content_round_trips_in_tool_turns():
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning_content": "need a tool", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]  # fmt: skip
    got = render_chat(msgs, [TOOL], release="v41")
    assert "<think>need a tool</think>\n\n<｜DSML｜ calls>" in got
    assert got.endswith("<tool_result>42</tool_result><｜Assistant｜><think>")
    msgs[1]["reasoning"] = msgs[1].pop("reasoning_content")  # vLLM's field name is accepted too
    assert render_chat(msgs, [TOOL], release="v41") == got


def test_trailing_assistant_message_is_a_prefix_to_continue():
    msgs = [*Q, {"role": "assistant", "content": "The answer is"}]
    assert render_chat(msgs, options=ChatOptions(thinking=False)) == (
        BOS + "<｜User｜>question<｜Assistant｜></think>The answer is"
    )


@pytest.mark.parametrize(
    "messages,tools,param",
    [
        ([], None, "messages"),
        ("hi", None, "messages"),
        (["hi"], None, "messages[0]"),
        ([{"role": "robot", "content": "x"}], None, "messages[0].role"),
        ([{"role": "user"}], None, "messages[0].content"),
        ([{"role": "user", "content": 5}], None, "messages[0].content"),
        ([{"role": "user", "content": [{"type": "audio"}]}], None, "messages[0].content[0]"),
        ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}, *Q], None,
         "messages[0].content[0]"),
        ([*Q, {"role": "assistant", "reasoning_content": 3}], None, "messages[1].reasoning_content"),
        ([*Q, {"role": "assistant", "tool_calls": {}}], None, "messages[1].tool_calls"),
        ([*Q, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], None,
         "messages[1].tool_calls[0].function.name"),
        ([*Q, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], None,
         "messages[1].tool_calls[0].function.arguments"),
        (Q, {"type": "function"}, "tools"),
        (Q, [{"type": "function", "function": {}}], "tools[0]"),
    ],
)  # fmt: skip
def test_invalid_requests_name_the_field(messages, tools, param):
    with pytest.raises(InvalidRequest) as e:
        render_chat(messages, tools)
    assert e.value.param == param


def test_images_are_unsupported_input_for_text_models():
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]
    with pytest.raises(UnsupportedInput, match="text only"):
        render_chat(msgs)
    with pytest.raises(UnsupportedInput):
        render_chat(msgs, release="v4", allow_images=True)


def test_chat_options_sources_and_precedence():
    assert chat_options() == ChatOptions(thinking=True)
    assert chat_options(thinking={"type": "disabled"}).thinking is False
    assert chat_options({"enable_thinking": False}).thinking is False
    assert chat_options({"thinking": True}, thinking={"type": "disabled"}).thinking is True
    assert chat_options(reasoning_effort="max").reasoning_effort == "max"
    assert chat_options({"reasoning_effort": 30}, reasoning_effort="max").reasoning_effort == 30
    assert chat_options({"drop_thinking": False}).drop_thinking is False
    off = ChatOptions(thinking=False)
    assert chat_options(defaults=off).thinking is False


@pytest.mark.parametrize(
    "kwargs,param",
    [({"foo": 1}, "chat_template_kwargs.foo"), ({"thinking": "yes"}, "chat_template_kwargs.thinking"), ([1], None)],
)
def test_chat_options_reject_unknown_or_mistyped_keys(kwargs, param):
    with pytest.raises(InvalidRequest) as e:
        chat_options(kwargs)
    assert e.value.param == (param or "chat_template_kwargs")


@pytest.mark.parametrize("thinking,param", [({"type": "auto"}, "thinking.type"), ("on", "thinking")])
def test_chat_options_reject_bad_thinking_switch(thinking, param):
    with pytest.raises(InvalidRequest) as e:
        chat_options(thinking=thinking)
    assert e.value.param == param


def test_render_chat_applies_options():
    got = render_chat(Q, options=chat_options({"reasoning_effort": 7}))
    assert got == BOS + EFFORT.format(7) + "<｜User｜>question<｜Assistant｜><think>"


def test_openai_to_native_does_not_mutate_the_request():
    msgs = [{"role": "user", "content": "q"}]
    native = openai_to_native(msgs, [TOOL])
    assert native[0]["role"] == "system" and msgs == [{"role": "user", "content": "q"}]


def test_encode_chat_starts_with_a_single_bos():
    tok = Tokenizer.bundled("v41")
    ids = encode_chat(tok, [{"role": "system", "content": "S"}, *Q], release="v41")
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids[1] == tok.token_to_id("<｜System｜>")
    assert ids[-2:] == [tok.token_to_id("<｜Assistant｜>"), tok.think_open_id]
    assert encode_chat(tok, Q, max_prompt_tokens=len(ids)) == tok.encode(render_chat(Q))
    with pytest.raises(ContextTooLong) as e:
        encode_chat(tok, [{"role": "user", "content": "word " * 50}], max_prompt_tokens=20)
    assert e.value.param == "messages" and "at most 20" in str(e.value)


# ---- parsing completions ------------------------------------------------------------------------------------------


def test_parse_completion_chat_mode_and_unclosed_reasoning():
    assert parse_completion("Hi!" + EOS, thinking=False).content == "Hi!"
    cut = parse_completion("still thinking", thinking=True)
    assert (cut.reasoning, cut.content) == ("still thinking", "")


def test_parse_completion_malformed_call_is_content():
    text = '</think>ok\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\nnot a parameter\n</｜DSML｜ invoke>'
    parsed = parse_completion(text)
    assert parsed.tool_calls == []
    assert parsed.content.startswith("ok") and "not a parameter" in parsed.content


def test_parsed_message_shape():
    msg = parse_completion(V41_CALL, new_id=lambda: "call_x").to_message()
    assert msg["role"] == "assistant" and msg["reasoning_content"] == "  reason  "
    assert msg["tool_calls"] == [
        {
            "id": "call_x",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"query": "value", "limit": 2}'},
        }
    ]
