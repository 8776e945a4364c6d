"""DSML tool calls: the tools prompt and assistant calls (rendering), and a streaming, never-raising parser."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dsflash.text.stops import find_earliest, partial_suffix_len
from dsflash.text.tokenizer import DSML, THINK_CLOSE, THINK_OPEN, V4, V41, normalize_release


@dataclass(frozen=True)
class Syntax:
    """Tag names of one release: V4 `tool_calls`/`invoke`/`parameter`, V4.1 the same with a leading space."""

    block: str
    invoke: str
    parameter: str


SYNTAX = {V4: Syntax("tool_calls", "invoke", "parameter"), V41: Syntax(" calls", " invoke", " parameter")}

# The parser accepts either release's spelling (and the `function_calls` name models sometimes drift to): a
# well-formed call in the "wrong" dialect is still a call, and leaking it as content is the top user complaint.
_BLOCK_NAMES = ("tool_calls", " calls", " tool_calls", "calls", "function_calls", " function_calls")
BLOCK_OPENERS = tuple(f"<{DSML}{n}>" for n in _BLOCK_NAMES)
_BLOCK_CLOSERS = tuple(f"</{DSML}{n}>" for n in _BLOCK_NAMES)
# A canonical block follows the content after a blank line; the newlines are separator, not content.
_OPENER_PREFIXES = tuple(p + o for o in BLOCK_OPENERS for p in ("", "\n", "\n\n"))
_D = re.escape(DSML)
_INVOKE_OPEN = re.compile(rf'<{_D} ?invoke\s+name="([^"]*)"\s*>')
_INVOKE_CLOSE = re.compile(rf"</{_D} ?invoke\s*>")
_PARAM_OPEN = re.compile(rf'<{_D} ?parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>')
_PARAM_CLOSE = re.compile(rf"</{_D} ?parameter\s{{0,4}}>")
_HEADS = (f"<{DSML}invoke", f"<{DSML} invoke", f"<{DSML}parameter", f"<{DSML} parameter")
_CLOSE_HEADS = (f"</{DSML}invoke", f"</{DSML} invoke", *(c[:-1] for c in _BLOCK_CLOSERS))
_CLOSE_MAX = len(f"</{DSML} parameter") + 5  # the longest parameter closer _PARAM_CLOSE accepts
_ATTRS_MAX = 1024  # a tag whose attributes run longer than this without '>' is not a tag

_TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{B}>" block \
like the following:

<{B}>
<{I} name="$TOOL_NAME">
<{P} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{P}>
...
</{I}>
<{I} name="$TOOL_NAME2">
...
</{I}>
</{B}>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, \
objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {T0}), you MUST output your complete reasoning inside {T0}...{T1} BEFORE any \
tool calls or final response.

Otherwise, output directly after {T1} with tool calls or final response.

### Available Tool Schemas

{SCHEMAS}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value) -> str:
    """JSON as DeepSeek's encoder writes it: default separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def render_tools_prompt(functions: Iterable[dict], release: str = V41) -> str:
    """The '## Tools' block for a system message; `functions` are the OpenAI `tool["function"]` objects."""
    s = SYNTAX[normalize_release(release)]
    fill = {"B": DSML + s.block, "I": DSML + s.invoke, "P": DSML + s.parameter, "T0": THINK_OPEN, "T1": THINK_CLOSE}
    text = _TOOLS_PROMPT
    for key, value in fill.items():
        text = text.replace("{" + key + "}", value)
    return text.replace("{SCHEMAS}", "\n".join(to_json(f) for f in functions))


def render_tool_calls(calls: Iterable[tuple[str, dict]], release: str = V41) -> str:
    """Assistant tool calls as a DSML block (with its leading blank line); calls are (name, arguments object)."""
    s = SYNTAX[normalize_release(release)]
    invokes = []
    for name, arguments in calls:
        params = "\n".join(
            f'<{DSML}{s.parameter} name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else to_json(v)}</{DSML}{s.parameter}>"
            for k, v in arguments.items()
        )
        invokes.append(f'<{DSML}{s.invoke} name="{name}">\n{params}\n</{DSML}{s.invoke}>')
    return f"\n\n<{DSML}{s.block}>\n" + "\n".join(invokes) + f"\n</{DSML}{s.block}>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is a JSON object as a string, as OpenAI sends it."""

    index: int
    id: str
    name: str
    arguments: str

    def to_message(self) -> dict:
        """The entry of `message.tool_calls` in a non-streamed response."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_delta(self) -> dict:
        """The entry of `delta.tool_calls` in a streamed chunk (the whole call in one delta)."""
        return {"index": self.index, **self.to_message()}


def _argument_json(params: list[tuple[str, str, str | None]]) -> str:
    """DSML parameters -> JSON object text; string="false" values stay as written when they are valid JSON."""
    fields: dict[str, str] = {}
    for name, value, string in params:
        raw = value.strip()
        if string == "false":
            try:
                json.loads(raw)
                fields[name] = raw
                continue
            except ValueError:
                pass  # the model promised JSON and broke it: keep the text as a string rather than emit bad JSON
        fields[name] = to_json(value)
    return "{" + ", ".join(f"{to_json(k)}: {v}" for k, v in fields.items()) + "}"


def _new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _wait_or_fail(body: str) -> int | None:
    """None while `body` may still become a tag (a partial head, or a head whose attributes are arriving), else -1."""
    if any(h.startswith(body) for h in _HEADS + _CLOSE_HEADS):
        return None
    if any(body.startswith(h) for h in _HEADS + _CLOSE_HEADS) and ">" not in body[:_ATTRS_MAX]:
        return None if len(body) < _ATTRS_MAX else -1
    return -1


class ToolCallParser:
    """feed(text) -> [str | ToolCall]: content text and complete calls, in stream order.

    Text that may begin a DSML block is held back; a call is released when its invoke closes. Anything that does not
    parse (or is cut off by the end of the stream) comes back as content text: the parser never raises.
    """

    def __init__(self, new_id: Callable[[], str] = _new_call_id):
        self._new_id = new_id
        self._state = "content"  # content | block | plain (after a malformed block everything is content)
        self._buf = ""
        self._raw = ""  # block text consumed since the last released call: it becomes content if the block breaks
        self._invoke: tuple[str, list] | None = None
        self._block_calls = 0
        self._value: list[str] | None = None  # chunks of a long parameter value whose closer has not come yet
        self._tail = ""  # the last characters of that value: a closer that arrives must overlap them
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCall]:
        """Consume a chunk; return what is now certain."""
        if self._value is not None:
            # inside a long value only the seam can hold its closer: append, and rescan once the closer is there
            seam = self._tail + text
            self._value.append(text)
            if _PARAM_CLOSE.search(seam) is None:
                self._tail = seam[-_CLOSE_MAX:]
                return []
            self._join_value()
        else:
            self._buf += text
        out: list[str | ToolCall] = []
        while self._buf:
            state = self._state
            if state == "plain":
                out.append(self._buf)
                self._buf = ""
            elif state == "content":
                self._scan_content(out)
            else:
                self._scan_block(out)
            if self._state == state:
                break  # no transition: the rest waits for more text
        return [x for x in out if x != ""]

    def finish(self) -> list[str | ToolCall]:
        """End of stream: flush held content; an unfinished block degrades to content."""
        self._join_value()
        out: list[str | ToolCall] = []
        rest = self._buf.strip()
        if self._state != "block":
            out.append(self._buf)
        elif self._invoke is not None or self._block_calls == 0:
            out.append(self._raw + self._buf)
        elif rest and not any(c.startswith(rest) for c in _BLOCK_CLOSERS):
            out.append(self._buf)  # text after the last call; only a missing or cut-off block closer is forgiven
        self._buf, self._raw, self._invoke, self._state = "", "", None, "content"
        return [x for x in out if x != ""]

    def _join_value(self) -> None:
        if self._value is not None:
            self._buf += "".join(self._value)
            self._value = None

    def _scan_content(self, out: list) -> None:
        """Emit content up to a block opener (then switch to block state) or up to a possible partial opener."""
        hit = find_earliest(self._buf, BLOCK_OPENERS)
        if hit is None:
            keep = partial_suffix_len(self._buf, _OPENER_PREFIXES)
            out.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return
        pos, opener = hit
        content = self._buf[:pos]
        out.append(content[:-2] if content.endswith("\n\n") else content.removesuffix("\n"))
        self._raw = self._buf[pos : pos + len(opener)]
        self._buf = self._buf[pos + len(opener) :]
        self._state, self._block_calls = "block", 0

    def _scan_block(self, out: list) -> None:
        """Consume complete tags at the head of the block; wait on a partial tag; degrade on anything else."""
        while self._state == "block":
            body = self._buf.lstrip()
            if not body:
                return
            released = len(self.calls)
            step = self._between_invokes(body) if self._invoke is None else self._inside_invoke(body, out)
            if step is None:
                return
            if step < 0:
                out.append(self._raw + self._buf)
                self._state, self._buf, self._raw, self._invoke = "plain", "", "", None
                return
            consumed = self._buf[: len(self._buf) - len(body) + step]
            self._buf = body[step:]
            self._raw = "" if len(self.calls) > released else self._raw + consumed

    def _between_invokes(self, body: str) -> int | None:
        """An invoke opener or the block closer; chars consumed, None to wait, -1 when malformed."""
        m = _INVOKE_OPEN.match(body)
        if m:
            self._invoke = (m.group(1), [])
            return m.end()
        for closer in _BLOCK_CLOSERS:
            if body.startswith(closer):
                if self._block_calls == 0:
                    return -1  # an empty block is no call: the client should see the text
                self._state, self._raw = "content", ""
                return len(closer)
        return _wait_or_fail(body)

    def _inside_invoke(self, body: str, out: list) -> int | None:
        """A whole parameter, or the invoke closer, which releases the call."""
        m = _INVOKE_CLOSE.match(body)
        if m:
            name, params = self._invoke
            call = ToolCall(len(self.calls), self._new_id(), name, _argument_json(params))
            self.calls.append(call)
            out.append(call)
            self._invoke = None
            self._block_calls += 1
            return m.end()
        m = _PARAM_OPEN.match(body)
        if m:
            close = _PARAM_CLOSE.search(body, m.end())
            if close is None:
                self._value, self._tail = [], body[-_CLOSE_MAX:]
                return None
            self._invoke[1].append((m.group(1), body[m.end() : close.start()], m.group(2)))
            return close.end()
        return _wait_or_fail(body)
