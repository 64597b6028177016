"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Every request field is honoured or refused: unknown fields get 400 naming them, and the
known ones braid does not implement (`best_of` > 1, `tools` on completions, vLLM's
removed `guided_*` fields) get 400 from `unsupported_field`. `user`, and chat's `metadata`,
`store`, `service_tier`, `prompt_cache_key`, `safety_identifier` and `reasoning_effort`, are
accepted and unused (they change no output).
Structured output comes as OpenAI's `response_format` or vLLM's `structured_outputs`.
Text that cannot be UTF-8 (a lone surrogate such as "\ud800") is refused where it enters.
Responses carry one extra field, `braid`: per-response speculation figures and preemptions.
"""

from __future__ import annotations

import secrets
import time
import types
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text must be valid UTF-8: {e.reason} at index {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]


def _takes_null(annotation: Any) -> bool:
    return annotation is Any or annotation is None or type(None) in get_args(annotation) or any(
        _takes_null(a) for a in get_args(annotation) if isinstance(a, types.UnionType))


class Options(BaseModel):
    """A request body or part: `null` for a field that takes no null is its default, as vLLM
    (whose fields are Optional) and OpenAI take it: clients send unset options as null."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None or k not in cls.model_fields
                or _takes_null(cls.model_fields[k].annotation)}


class StreamOptions(Options):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = True  # as in vLLM: `stream_options: {}` asks for usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk


class StructuredOutputsRequest(Options):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: Text | None = None

    def as_params_dict(self) -> dict[str, Any]:
        return {"json": self.json_, **self.model_dump(exclude={"json_"})}


class JsonSchemaFormat(Options):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is always honoured)."""

    model_config = ConfigDict(extra="forbid")

    name: Text = "response"
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Options):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(Options):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Python's JSON reader takes NaN and Infinity, and pydantic the strings "nan" and "inf":
    # none is a sampling parameter
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's; the same text here (SamplingParams)
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    # vLLM's: keep the prompt's last k tokens (-1: max_model_len); the response id's tail
    truncate_prompt_tokens: int | None = None
    request_id: Text | None = None
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:<id>"
    prompt_logprobs: int | None = Field(None, ge=-1)  # at most --max-logprobs; -1: all
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # Known fields refused until implemented (see `unsupported_field`).
    best_of: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (stream_options.continuous_usage_stats, which vLLM
        honours only beside include_usage)."""
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, why) for the first field set to something braid does not do (yet)."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "only with stream: true (as vLLM has it)"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported; use n"
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                return name, (f"use structured_outputs.{name.removeprefix('guided_')} "
                              "(vLLM's current name)")
        return None

    def structured(self) -> tuple[str, dict[str, Any]] | None:
        """(the field it came from, StructuredOutputsParams fields), or None; ValueError
        naming the field when both ways are used or a json_schema has no schema."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if self.structured_outputs is not None:
                raise ValueError("response_format: set it or structured_outputs, not both")
            if fmt.type == "json_object":
                return "response_format", {"json_object": True}
            if fmt.json_schema is None:
                raise ValueError("response_format.json_schema is required when type is "
                                 "json_schema")
            return "response_format.json_schema.schema", {"json": fmt.json_schema.schema_}
        if self.structured_outputs is not None:
            return "structured_outputs", self.structured_outputs.as_params_dict()
        return None

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with integer token ids (ValueError naming the field otherwise)."""
        if self.logit_bias is None:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids, got "
                             f"{list(self.logit_bias)[:5]!r}") from None


class CompletionRequest(SamplingRequest):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    add_special_tokens: bool = True
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=-1)  # at most --max-logprobs; -1: all
    echo: bool = False
    suffix: Text | None = None  # fill in the middle, with a code model's FIM tokens
    tools: list[Any] | None = None
    tool_choice: Any = None

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calling is on /v1/chat/completions"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool calling is on /v1/chat/completions"
        return super().unsupported_field()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = "text"
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Text
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content is one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)  # as vLLM
        message.setdefault("content", "")
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # accepted; required and named choices always obey the schema


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)  # at most --max-logprobs; -1: all
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the template writes them
    echo: bool = False  # vLLM's: the last message's content leads the reply (a prefill)
    documents: list[dict[str, Text]] | None = None  # for a RAG template, as vLLM passes them
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's bookkeeping and routing hints, accepted and unused: none changes the output
    # (braid stores no completion, and its prefix cache needs no key)
    metadata: dict[str, Text] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None  # no reasoning


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class BraidInfo(BaseModel):
    """braid's own figures for one response: preemptions and speculation (the engine's
    per-request `metrics.spec_stats`, summed over the choices)."""

    num_preemptions: int = 0
    spec: dict[str, Any] = Field(default_factory=dict)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # vLLM's shape: token id -> entry


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
    prompt_logprobs: PromptLogprobs | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = "function"
    function: DeltaFunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # in the choice's last chunk


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
    # the conversation's, once for all choices, where vLLM puts it (completions: per choice)
    prompt_logprobs: PromptLogprobs | None = None


class CompletionStreamResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class ModelPermission(BaseModel):
    """vLLM's (OpenAI's former) permission entry of a model card: what clients may do."""
    id: str = Field(default_factory=lambda: f"modelperm-{secrets.token_hex(16)}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "braid"
    root: str | None = None  # the model it serves (--model), as vLLM's card says
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(Options):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Options):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    tools: list[ToolDefinition] | None = None
    documents: list[dict[str, Text]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: the vocabulary's spellings


class DetokenizeRequest(Options):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
