"""Response shapes as pydantic models: the OpenAPI document's response schemas (render.py builds the same objects
as plain dicts, which is cheaper per streamed token; tests/unit/test_server_models.py holds the two together)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    error: ErrorInfo


class PromptTokensDetails(_Out):
    cached_tokens: int


class CompletionTokensDetails(_Out):
    reasoning_tokens: int


class UsageInfo(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob] | None
    refusal: None = None


class PromptLogprob(_Out):
    """vLLM's prompt_logprobs entry: one per token id (the prompt's token and the top alternatives)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class FunctionCall(_Out):
    name: str
    arguments: str


class ToolCall(_Out):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo | None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Out):
    prompt: str


class Health(_Out):
    status: Literal["ok"]


class Version(_Out):
    version: str
    model: str
    revision: str | None


class TokenizerInfo(_Out):
    """What a client needs to count and decode tokens without downloading the tokenizer (as vLLM's route)."""

    tokenizer_class: str
    model_max_length: int
    vocab_size: int
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token: str | None
    add_bos_token: bool
    chat_template: str | None = None
    tokenizer_source: str | None = None
    extra: dict[str, Any] | None = None


# the top-level response models /openapi.json names (their parts come along)
class ResponsesUsage(_Out):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(_Out):
    """POST /v1/responses: output items are `reasoning`, `message` and `function_call` (server/responses_api.py)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    incomplete_details: dict[str, Any] | None = None
    usage: ResponsesUsage | None = None


DOCUMENTED = (
    "ErrorResponse",
    "ModelList",
    "ModelCard",
    "ChatCompletionResponse",
    "CompletionResponse",
    "ResponseObject",
    "TokenizeResponse",
    "DetokenizeResponse",
    "Health",
    "Version",
    "TokenizerInfo",
)
