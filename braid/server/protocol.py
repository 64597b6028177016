"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Unknown request fields are ignored, as vLLM does, so clients that send extra options work.
Responses carry one extra field, `braid`: per-response speculation figures and preemptions.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content is one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


# ---- responses ----------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class BraidInfo(BaseModel):
    """braid's own figures for one response: preemptions and speculation (the engine's
    per-request `metrics.spec`, summed over the choices)."""

    num_preemptions: int = 0
    spec: dict[str, Any] = Field(default_factory=dict)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo | None = None
    braid: BraidInfo | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class CompletionStreamResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "braid"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
