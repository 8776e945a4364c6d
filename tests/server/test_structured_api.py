"""Black-box, the official openai client (strict validation) against the real server and the embedded random model:
response_format json_schema (streamed and not), tool_choice required / named, and /v1/responses (text, messages,
instructions, events, reasoning items, a function tool round trip, max_output_tokens, usage)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

THINK_OFF = {"chat_template_kwargs": {"thinking": False}}
Q = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["dev", "ops"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 5}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
RESP_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}


def test_json_schema_streamed_and_not(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model=model, messages=Q, max_tokens=60, seed=1, response_format=fmt, extra_body=THINK_OFF)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    assert streamed == r.choices[0].message.content  # the same seed: the same grammar-constrained draw


def test_structured_output_in_thinking_mode_through_the_parse_helper(client, model):
    # thinking on (the default): the random model rarely closes `</think>`, so this asks for the reasoning to be
    # cut short by max_tokens; what must hold is that the request is accepted and reasoning stays free text
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.chat.completions.create(model=model, messages=Q, max_tokens=8, response_format=fmt)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.model_extra["reasoning_content"]


def test_named_tool_call(client, model):
    # "required" (the same grammar over every tool) and the streamed rendering are covered in-process
    # (test_structured.py) and by /v1/responses below: a forced call is ~50 tokens of the embedded model
    tools = [CHAT_TOOL, {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=model, messages=Q, max_tokens=200, seed=3, tools=tools, tool_choice=choice,
              parallel_tool_calls=False, extra_body=THINK_OFF)  # fmt: skip
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_unsupported_schema_is_a_400_naming_it(client, model):
    bad = {"type": "object", "properties": {"a": {"type": "string", "format": "weird"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=Q, max_tokens=4, response_format=fmt)
    assert "weird" in e.value.message and e.value.param == "response_format"


# ---- /v1/responses ------------------------------------------------------------------------------------------------
def test_responses_text_input_with_instructions_and_usage(client, model):
    r = client.responses.create(model=model, input="Hello", instructions="Be brief.", max_output_tokens=6,
                                reasoning={"effort": "none"})  # fmt: skip
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in r.output] == ["message"] and r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.instructions == "Be brief." and r.max_output_tokens == 6


def test_responses_reasoning_item_and_stream_events(client, model):
    kw = dict(model=model, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
              max_output_tokens=5)  # fmt: skip
    full = client.responses.create(**kw)
    assert [i.type for i in full.output] == ["reasoning"] and full.usage.output_tokens_details.reasoning_tokens == 5
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert events[-1].response.output[0].content[0].text == text


def test_responses_function_tool_round_trip_and_json_format(client, model):
    kw = dict(model=model, tools=[RESP_TOOL], tool_choice="required", reasoning={"effort": "none"},
              max_output_tokens=200)  # fmt: skip
    events = list(client.responses.create(input="Weather in Paris?", stream=True, **kw))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    first = events[-1].response
    calls = [i for i in first.output if i.type == "function_call"]
    assert events[-1].type == "response.completed" and first.status == "completed"
    assert calls and calls[0].name == "get_weather" and done[0].arguments == calls[0].arguments
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    # the call and its output go back as items; the answer is then JSON in the asked format
    items = [{"role": "user", "content": "Weather in Paris?"}, calls[0].model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 21}'}]  # fmt: skip
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
    second = client.responses.create(model=model, input=items, tools=[RESP_TOOL], text=fmt,
                                     reasoning={"effort": "none"}, max_output_tokens=60)  # fmt: skip
    assert second.status == "completed" and [i.type for i in second.output] == ["message"]
    jsonschema.validate(json.loads(second.output_text), PERSON)


def test_responses_refusals(server, client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", previous_response_id="resp_1")
    assert e.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    assert e.value.param == "tools[0].type"
    r = httpx.post(server.base + "/v1/responses", json={"input": [{"type": "image", "x": 1}]}, headers=server.headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].type"
