"""DeepSeek V4 / V4.1 chat encoding (v41_spec.md §6.3-6.4): messages -> prompt text, and completion -> message.

Two layers. `render_messages` takes DeepSeek-native messages (roles system/user/assistant/tool/developer/
latest_reminder, `tools` on a system or developer message, `task`, `wo_eos`) and reproduces DeepSeek's encoder
byte for byte. `render_chat` takes an OpenAI request (messages, tools, options), validates it with errors that name
the offending field, and maps it onto the native form.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from dsflash.errors import ContextTooLong, InvalidRequest, UnsupportedInput
from dsflash.text.reasoning import split_reasoning
from dsflash.text.tokenizer import BOS, EOS, IMAGE, SYSTEM, THINK_CLOSE, THINK_OPEN, V41, Tokenizer
from dsflash.text.tokenizer import normalize_release as _release
from dsflash.text.tools import ToolCall, ToolCallParser, render_tool_calls, render_tools_prompt, to_json

USER, ASSISTANT, REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
TASKS = {t: f"<｜{t}｜>" for t in ("action", "query", "authority", "domain", "title", "read_url")}

_V4_MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
_V41_EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
# "medium" is OpenAI's usual value; DeepSeek's API treats it (and "low" on V4) as "high", and V4 maps "xhigh" to max.
_V41_LEVELS = {"low": 25, "medium": 50, "high": 50, "xhigh": 75, "max": 100}
_V4_LEVELS = {"low": "", "medium": "", "high": "", "xhigh": _V4_MAX_EFFORT, "max": _V4_MAX_EFFORT}
_RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{}"
# A literal image placeholder in text would reach a text model as an image token with no image; spell it with
# ASCII bars so it stays text (rejecting it instead leaves clients that resend history stuck on a 400).
_IMAGE_ESCAPED = IMAGE.replace("｜", "|")


def effort_prompt(release: str, reasoning_effort: str | int | None) -> str:
    """The effort paragraph that opens a thinking-mode prompt ('' for none); rejects values the release lacks."""
    release, effort = _release(release), reasoning_effort
    levels = _V41_LEVELS if release == V41 else _V4_LEVELS
    if effort is None:
        effort = "high"
    if isinstance(effort, str) and effort in levels:
        level = levels[effort]
        return _V41_EFFORT.format(level) if release == V41 else level
    if release == V41 and type(effort) is int and 1 <= effort <= 100:
        return _V41_EFFORT.format(effort)
    allowed = "an integer 1-100 or one of " if release == V41 else "one of "
    raise InvalidRequest(
        f"reasoning_effort must be {allowed}{', '.join(levels)}; got {effort!r}", param="reasoning_effort"
    )


@dataclass(frozen=True)
class _Ctx:
    release: str
    thinking: bool
    drop: bool
    last_user: int


def _user_like(msg: Mapping, index: int, release: str) -> bool:
    """Turns after which the assistant answers; a mid-conversation system message is one in V4.1."""
    role = msg.get("role")
    return role in ("user", "developer") or (release == V41 and role == "system" and index > 0)


def _last_user_index(msgs: Sequence[Mapping], release: str) -> int:
    return max((i for i, m in enumerate(msgs) if _user_like(m, i, release)), default=-1)


def _text(value, release: str) -> str:
    """Message text (None -> ''), with the V4.1 image placeholder escaped."""
    text = "" if value is None else str(value)
    return text.replace(IMAGE, _IMAGE_ESCAPED) if release == V41 else text


def _blocks(content) -> list[dict]:
    """User content as blocks: a string is one text block; a list is taken as OpenAI-style parts."""
    if isinstance(content, list):
        return [dict(b) if isinstance(b, Mapping) else {"type": "text", "text": str(b)} for b in content]
    return [{"type": "text", "text": content}]


def _merge_tool_messages(messages: Sequence[Mapping]) -> list[dict]:
    """Tool results become <tool_result> blocks of a user turn; consecutive user turns merge (as DeepSeek's do)."""
    merged: list[dict] = []
    for msg in messages:
        role = msg.get("role")
        open_user = merged and merged[-1].get("role") == "user" and merged[-1].get("task") is None
        if role == "tool":
            block = {"type": "tool_result", "id": msg.get("tool_call_id") or "", "content": msg.get("content")}
            if merged and merged[-1].get("role") == "user":
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user" and open_user:
            merged[-1]["blocks"].extend(_blocks(msg.get("content")))
        elif role == "user":
            merged.append({**msg, "blocks": _blocks(msg.get("content"))})
        else:
            merged.append(dict(msg))
    return merged


def _sort_tool_results(msgs: list[dict]) -> list[dict]:
    """Within a user turn, tool results follow the order of the calls of the assistant turn before it."""
    order: dict[str, int] = {}
    for msg in msgs:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {tc.get("id"): i for i, tc in enumerate(msg["tool_calls"]) if tc.get("id")}
        elif msg.get("role") == "user" and order and "blocks" in msg:
            results = [b for b in msg["blocks"] if b.get("type") == "tool_result"]
            ranked = iter(sorted(results, key=lambda b: order.get(b.get("id"), 0)))  # stable, unknown ids first
            msg["blocks"] = [next(ranked) if b.get("type") == "tool_result" else b for b in msg["blocks"]]
    return msgs


def _drop_old_thinking(msgs: list[dict], release: str) -> list[dict]:
    """Before the last user turn: assistants lose their reasoning and developer turns go (DeepSeek's drop rule)."""
    last = _last_user_index(msgs, release)
    kept = []
    for i, msg in enumerate(msgs):
        if i >= last or msg.get("role") in ("user", "system", "tool", "latest_reminder"):
            kept.append(msg)
        elif msg.get("role") == "assistant":
            kept.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return kept


def _render_block(block: Mapping, release: str) -> str:
    kind = block.get("type")
    if kind == "text":
        return _text(block.get("text"), release)
    if kind in ("image", "image_url"):
        if release != V41:
            raise UnsupportedInput("DeepSeek V4 has no image input; use a V4.1 vision model")
        return IMAGE
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, list):
            content = "\n\n".join(
                _text(b.get("text"), release) if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
                for b in content
            )
        return f"<tool_result>{_text(content, release)}</tool_result>"
    return f"[Unsupported {kind}]"


def _instructions(msg: Mapping, release: str) -> str:
    """The tools and response-format blocks a system or developer message carries."""
    out = ""
    if msg.get("tools"):
        out += "\n\n" + render_tools_prompt((t["function"] for t in msg["tools"]), release)
    if msg.get("response_format"):
        out += "\n\n" + _RESPONSE_FORMAT.format(to_json(msg["response_format"]))
    return out


def _call_arguments(tool_call: Mapping) -> tuple[str, dict]:
    """(name, arguments object) of an OpenAI-format assistant tool call."""
    fn = tool_call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise InvalidRequest(f"tool call {fn.get('name')!r}: function.arguments must be a JSON object")
    return fn.get("name"), args


def _render_assistant(i: int, msgs: Sequence[Mapping], ctx: _Ctx) -> str:
    msg = msgs[i]
    calls = (
        render_tool_calls([_call_arguments(tc) for tc in msg["tool_calls"]], ctx.release)
        if msg.get("tool_calls")
        else ""
    )
    reasoning = ""
    after_task = i > 0 and msgs[i - 1].get("task") is not None  # a task answer is a label, never thought about
    if ctx.thinking and not after_task and (not ctx.drop or i > ctx.last_user):
        reasoning = _text(msg.get("reasoning_content"), ctx.release) + THINK_CLOSE
    text = reasoning + _text(msg.get("content"), ctx.release) + calls
    return text if msg.get("wo_eos") else text + EOS


def _render_body(i: int, msgs: Sequence[Mapping], ctx: _Ctx) -> str:
    msg, role = msgs[i], msgs[i].get("role")
    if role == "system":
        head = SYSTEM if ctx.release == V41 and i > 0 else ""
        return head + _text(msg.get("content"), ctx.release) + _instructions(msg, ctx.release)
    if role == "developer":
        return USER + _text(msg.get("content"), ctx.release) + _instructions(msg, ctx.release)
    if role == "user":
        blocks = msg.get("blocks") or _blocks(msg.get("content"))
        return USER + "\n\n".join(_render_block(b, ctx.release) for b in blocks)
    if role == "latest_reminder":
        return REMINDER + _text(msg.get("content"), ctx.release)
    if role == "assistant":
        return _render_assistant(i, msgs, ctx)
    raise InvalidRequest(f"unknown message role {role!r}", param=f"messages[{i}].role")


def _render_transition(i: int, msgs: Sequence[Mapping], ctx: _Ctx) -> str:
    """What follows a turn: the assistant header (with <think> or </think>) or a task token."""
    if i + 1 < len(msgs) and msgs[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return ""
    msg, task = msgs[i], msgs[i].get("task")
    if task is not None:
        if task not in TASKS:
            raise InvalidRequest(f"unknown task {task!r} (one of {', '.join(TASKS)})", param="task")
        if task != "action":
            return TASKS[task]
        return ASSISTANT + (THINK_OPEN if ctx.thinking else THINK_CLOSE) + TASKS[task]
    if not _user_like(msg, i, ctx.release):
        return ""
    think = ctx.thinking and (not ctx.drop or i >= ctx.last_user)
    return ASSISTANT + (THINK_OPEN if think else THINK_CLOSE)


def render_messages(
    messages: Sequence[Mapping],
    *,
    release: str = V41,
    thinking: bool = True,
    reasoning_effort: str | int | None = None,
    drop_thinking: bool = True,
    add_bos: bool = True,
) -> str:
    """DeepSeek-native messages -> prompt text, exactly as DeepSeek's V4 / V4.1 encoder writes it."""
    release = _release(release)
    effort = effort_prompt(release, reasoning_effort)  # validated in chat mode too, as the reference does
    effort = effort if thinking else ""
    msgs = _sort_tool_results(_merge_tool_messages(messages))
    drop = drop_thinking and not any(m.get("tools") for m in msgs)  # tool use keeps every turn's reasoning
    if thinking and drop:
        msgs = _drop_old_thinking(msgs, release)
    ctx = _Ctx(release, thinking, drop, _last_user_index(msgs, release))
    out = [BOS] if add_bos else []
    for i, msg in enumerate(msgs):
        if i == 0:
            host = release == V41 and (effort or msg.get("role") == "system")
            out.append((SYSTEM if host else "") + effort)
        out.append(_render_body(i, msgs, ctx))
        out.append(_render_transition(i, msgs, ctx))
    return "".join(out)


# ---- OpenAI requests -------------------------------------------------------------------------------------------

_ROLES = ("system", "developer", "user", "assistant", "tool")
_KWARGS = ("thinking", "enable_thinking", "reasoning_effort", "drop_thinking")


@dataclass(frozen=True)
class ChatOptions:
    """How to render a request: thinking on/off (DeepSeek's API default is on), effort, drop old reasoning."""

    thinking: bool = True
    reasoning_effort: str | int | None = None
    drop_thinking: bool = True


def _bool(value, param: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{param} must be true or false", param=param)
    return value


def chat_options(
    chat_template_kwargs: Mapping | None = None,
    *,
    reasoning_effort: str | int | None = None,
    thinking: Mapping | bool | None = None,
    defaults: ChatOptions = ChatOptions(),
) -> ChatOptions:
    """Options from a request: DeepSeek's `thinking: {"type": "enabled"|"disabled"}`, top-level `reasoning_effort`,
    then `chat_template_kwargs` (thinking / enable_thinking / reasoning_effort / drop_thinking), which win."""
    opts = defaults
    if isinstance(thinking, Mapping):
        if thinking.get("type") not in ("enabled", "disabled"):
            raise InvalidRequest("thinking.type must be 'enabled' or 'disabled'", param="thinking.type")
        opts = replace(opts, thinking=thinking["type"] == "enabled")
    elif thinking is not None:
        opts = replace(opts, thinking=_bool(thinking, "thinking"))
    if reasoning_effort is not None:
        opts = replace(opts, reasoning_effort=reasoning_effort)
    kw = chat_template_kwargs or {}
    if not isinstance(kw, Mapping):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    for key in kw:
        if key not in _KWARGS:
            raise InvalidRequest(
                f"unknown chat_template_kwargs key {key!r} (known: {', '.join(_KWARGS)})",
                param=f"chat_template_kwargs.{key}",
            )
    for key in ("thinking", "enable_thinking"):
        if key in kw:
            opts = replace(opts, thinking=_bool(kw[key], f"chat_template_kwargs.{key}"))
    if "drop_thinking" in kw:
        opts = replace(opts, drop_thinking=_bool(kw["drop_thinking"], "chat_template_kwargs.drop_thinking"))
    if kw.get("reasoning_effort") is not None:
        opts = replace(opts, reasoning_effort=kw["reasoning_effort"])
    return opts


def _content(content, p: str, role: str, release: str, allow_images: bool):
    """A message's content: a string, None, or parts; parts stay a list only for user turns (images live there)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{p}.content must be a string or an array of content parts", param=f"{p}.content")
    parts = []
    for j, part in enumerate(content):
        q = f"{p}.content[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image_url", "image") and role == "user":
            if not allow_images or release != V41:
                raise UnsupportedInput(f"{q}: this model takes text only; image content is not supported")
            parts.append(dict(part))
        else:
            raise InvalidRequest(f"{q} must be a text part{' or an image part' if role == 'user' else ''}", param=q)
    return parts if role == "user" else "\n\n".join(x["text"] for x in parts)


def _tool_call(tc, q: str) -> dict:
    if not isinstance(tc, Mapping) or not isinstance(tc.get("function"), Mapping):
        raise InvalidRequest(f"{q} must be an object with a function", param=q)
    if not isinstance(tc["function"].get("name"), str) or not tc["function"]["name"]:
        raise InvalidRequest(f"{q}.function.name must be a non-empty string", param=f"{q}.function.name")
    try:
        name, args = _call_arguments(tc)
    except InvalidRequest as e:
        raise InvalidRequest(str(e), param=f"{q}.function.arguments") from None
    return {"id": tc.get("id"), "type": "function", "function": {"name": name, "arguments": args}}


def _message(i: int, msg, release: str, allow_images: bool) -> dict:
    """One OpenAI message -> DeepSeek-native; OpenAI's `developer` role means system instructions there."""
    p = f"messages[{i}]"
    if not isinstance(msg, Mapping):
        raise InvalidRequest(f"{p} must be an object", param=p)
    role = msg.get("role")
    if role not in _ROLES:
        raise InvalidRequest(f"{p}.role must be one of {', '.join(_ROLES)}; got {role!r}", param=f"{p}.role")
    role = "system" if role == "developer" else role
    content = _content(msg.get("content"), p, role, release, allow_images)
    if role == "user" and content is None:
        raise InvalidRequest(f"{p}.content is required for a user message", param=f"{p}.content")
    if role == "tool":
        return {"role": "tool", "tool_call_id": msg.get("tool_call_id"), "content": content}
    if role != "assistant":
        return {"role": role, "content": content}
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))  # vLLM renamed the field; accept both
    if reasoning is not None and not isinstance(reasoning, str):
        raise InvalidRequest(f"{p}.reasoning_content must be a string", param=f"{p}.reasoning_content")
    calls = [] if msg.get("tool_calls") is None else msg["tool_calls"]
    if not isinstance(calls, list):
        raise InvalidRequest(f"{p}.tool_calls must be an array", param=f"{p}.tool_calls")
    calls = [_tool_call(tc, f"{p}.tool_calls[{j}]") for j, tc in enumerate(calls)]
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls}


def _tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be an array", param="tools")
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or tool.get("type", "function") != "function" or not fn.get("name"):
            raise InvalidRequest(
                f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param=f"tools[{j}]"
            )
    return list(tools)


def openai_to_native(messages, tools=None, *, release: str = V41, allow_images: bool = False) -> list[dict]:
    """Validate an OpenAI messages + tools pair and map it onto DeepSeek-native messages."""
    release = _release(release)
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array", param="messages")
    native = [_message(i, m, release, allow_images) for i, m in enumerate(messages)]
    if native[-1]["role"] == "assistant":
        native[-1]["wo_eos"] = True  # a trailing assistant turn is a prefix for the model to continue
    tools = _tools(tools)
    if tools:
        # tools live on the first system message; without one we add an empty one (V4.1 then writes <｜System｜>)
        if native[0]["role"] != "system":
            native.insert(0, {"role": "system", "content": ""})
        native[0]["tools"] = tools
    return native


def render_chat(
    messages, tools=None, *, release: str = V41, options: ChatOptions = ChatOptions(), allow_images: bool = False
) -> str:
    """An OpenAI chat request -> prompt text."""
    native = openai_to_native(messages, tools, release=release, allow_images=allow_images)
    return render_messages(
        native,
        release=release,
        thinking=options.thinking,
        reasoning_effort=options.reasoning_effort,
        drop_thinking=options.drop_thinking,
    )


def encode_chat(
    tokenizer: Tokenizer, messages, tools=None, *, max_prompt_tokens: int | None = None, **kwargs
) -> list[int]:
    """An OpenAI chat request -> prompt token ids (the text starts with BOS itself); ContextTooLong past the limit."""
    ids = tokenizer.encode(render_chat(messages, tools, **kwargs))
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise ContextTooLong(f"the prompt is {len(ids)} tokens; at most {max_prompt_tokens} fit", param="messages")
    return ids


@dataclass(frozen=True)
class ParsedCompletion:
    """An assistant turn read back from generated text."""

    reasoning: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_message(self) -> dict:
        """As an OpenAI assistant message (also valid input for the next request)."""
        msg = {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_message() for c in self.tool_calls]
        return msg


def parse_completion(text: str, thinking: bool = True, **parser_kwargs) -> ParsedCompletion:
    """Generated text (up to EOS) -> reasoning, content and tool calls; malformed calls stay content."""
    text = text.split(EOS, 1)[0]
    reasoning, rest = split_reasoning(text, thinking)
    parser = ToolCallParser(**parser_kwargs)
    items = parser.feed(rest) + parser.finish()
    content = "".join(x for x in items if isinstance(x, str))
    return ParsedCompletion(reasoning, content, [x for x in items if isinstance(x, ToolCall)])
