"""The OpenAPI 3.1 document served at /openapi.json: what clients (and the fuzzer) may send and what comes back."""

from __future__ import annotations

from dsflash.server.protocol import ServedModel
from dsflash.service.api import MAX_LOGPROBS

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_STOP = {
    "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 64}, {"type": "null"}]
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "completion_tokens_details": {"type": "object", "properties": {"reasoning_tokens": {"type": "integer"}}},
    },
}


def _num(lo, hi, default, exclusive_lo: bool = False) -> dict:
    low = {"exclusiveMinimum": lo} if exclusive_lo else {"minimum": lo}
    return {"type": ["number", "null"], **low, "maximum": hi, "default": default}


def _sampling(served: ServedModel) -> dict:
    return {
        "model": {"type": ["string", "null"], "description": f"'{served.model_id}' (or one of its aliases)"},
        "stream": {"type": ["boolean", "null"], "default": False},
        "stream_options": {
            "type": ["object", "null"],
            "properties": {"include_usage": {"type": ["boolean", "null"]}},
            "description": "only with stream: true",
        },
        "temperature": _num(0, 2, 1),
        "top_p": _num(0, 1, 1, exclusive_lo=True),
        "top_k": {"type": ["integer", "null"], "minimum": -1, "description": "-1 or 0: off"},
        "min_p": _num(0, 1, 0),
        "seed": {"type": ["integer", "null"], "minimum": -(1 << 63), "maximum": (1 << 63) - 1},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 1},
        "stop": _STOP,
        "stop_token_ids": {
            "type": ["array", "null"],
            "items": {"type": "integer", "minimum": 0, "maximum": served.vocab_size - 1},
        },
        "ignore_eos": {"type": ["boolean", "null"]},
        "include_stop_str_in_output": {"type": ["boolean", "null"]},
        "skip_special_tokens": {"type": ["boolean", "null"]},
        "presence_penalty": {"type": ["number", "null"], "enum": [0, None]},
        "frequency_penalty": {"type": ["number", "null"], "enum": [0, None]},
        "repetition_penalty": {"type": ["number", "null"], "enum": [1, None]},
        "user": {"type": ["string", "null"]},
    }


def _responses(ok: dict, stream: bool = False) -> dict:
    content = {"application/json": {"schema": ok}}
    if stream:
        # each event is {"data": "<chunk JSON or [DONE]>"}
        content["text/event-stream"] = {"schema": {"type": "object", "properties": {"data": {"type": "string"}}}}
    err = {"content": {"application/json": {"schema": _ERROR}}}
    return {
        "200": {"description": "OK", "content": content},
        "400": {"description": "invalid request", **err},
        "404": {"description": "unknown model", **err},
        "413": {"description": "body over the size limit", **err},
        "429": {"description": "queue full; see Retry-After", **err},
        "503": {"description": "loading or shutting down", **err},
    }


def _message() -> dict:
    part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }
    return {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part}, {"type": "null"}]},
            "reasoning_content": {"type": ["string", "null"]},
            "reasoning": {"type": ["string", "null"]},
            "tool_calls": {"type": ["array", "null"], "items": {"type": "object"}},
            "tool_call_id": {"type": ["string", "null"]},
            "name": {"type": ["string", "null"]},
        },
    }


def openapi(served: ServedModel, auth: bool = False) -> dict:
    """The document; with auth, every route but /health, /metrics and this one declares the bearer key."""
    limit = served.max_len
    _token_id = {"type": "integer", "minimum": 0, "maximum": served.vocab_size - 1}
    chat = {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **_sampling(served),
            "messages": {"type": "array", "minItems": 1, "items": _message()},
            "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": limit},
            "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": limit},
            "logprobs": {"type": ["boolean", "null"]},
            "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
            "tools": {"type": ["array", "null"], "items": {"type": "object"}},
            "tool_choice": {"enum": ["auto", "none", None]},
            "parallel_tool_calls": {"type": ["boolean", "null"]},
            "chat_template_kwargs": {
                "type": ["object", "null"],
                "properties": {
                    "thinking": {"type": "boolean"},
                    "enable_thinking": {"type": "boolean"},
                    "reasoning_effort": {"type": ["string", "integer", "null"]},
                    "drop_thinking": {"type": "boolean"},
                },
                "additionalProperties": False,
            },
            "reasoning_effort": {
                "oneOf": [
                    {"enum": ["low", "medium", "high", "xhigh", "max", None]},
                    {"type": "integer", "minimum": 1, "maximum": 100},
                ]
            },
        },
    }
    completion = {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **_sampling(served),
            "prompt": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": _token_id},
                    {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}},
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 1,
                        "items": {"type": "array", "minItems": 1, "items": _token_id},
                    },
                ]
            },
            "max_tokens": {"type": ["integer", "null"], "minimum": 0, "maximum": limit, "default": 16},
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
            "echo": {"type": ["boolean", "null"]},
        },
    }
    tokenize = {
        "type": "object",
        "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
        "properties": {
            "model": {"type": ["string", "null"]},
            "prompt": {"type": "string"},
            "messages": {"type": ["array", "null"], "minItems": 1, "items": _message()},
            "add_special_tokens": {"type": ["boolean", "null"], "default": True},
            "return_token_strs": {"type": ["boolean", "null"]},
        },
    }
    detokenize = {
        "type": "object",
        "required": ["tokens"],
        "properties": {
            "model": {"type": ["string", "null"]},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": served.vocab_size - 1}},
        },
    }
    obj = {"type": "object"}

    def post(summary: str, schema: dict, ok: dict, stream: bool = False) -> dict:
        body = {"required": True, "content": {"application/json": {"schema": schema}}}
        return {"post": {"summary": summary, "requestBody": body, "responses": _responses(ok, stream)}}

    def get(summary: str, ok: dict, media: str = "application/json", errors: bool = True) -> dict:
        responses = {"200": {"description": "OK", "content": {media: {"schema": ok}}}}
        if errors:
            responses["503"] = {"description": "loading", "content": {"application/json": {"schema": _ERROR}}}
        return {"get": {"summary": summary, "responses": responses}}

    doc = {
        "openapi": "3.1.0",
        "info": {"title": "dsflash", "version": "1", "description": f"OpenAI-compatible API serving {served.model_id}"},
        "paths": {
            "/v1/models": get("the served model", obj),
            "/v1/chat/completions": post("chat completion", chat, obj, stream=True),
            "/v1/completions": post("text completion", completion, obj, stream=True),
            "/tokenize": post("prompt -> token ids", tokenize, obj),
            "/detokenize": post("token ids -> text", detokenize, obj),
            "/health": get("200 when ready, 503 while loading or shutting down", obj),
            "/metrics": get("Prometheus metrics", {"type": "string"}, "text/plain", errors=False),
        },
        "components": {"schemas": {"Error": _ERROR, "Usage": _USAGE}},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in doc["paths"].items():
            if path not in ("/health", "/metrics"):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
                    op["responses"]["401"] = {
                        "description": "missing or wrong API key",
                        "content": {"application/json": {"schema": _ERROR}},
                    }
    return doc
