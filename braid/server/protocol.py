"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Every request field is honoured or refused: unknown fields get 400 naming them, and the
known ones braid does not implement (`best_of` > 1, `tools` on completions, vLLM's
removed `guided_*` fields; on chat `modalities` other than ["text"], and a non-null `audio`,
`web_search_options`, `moderation`, `functions` or `function_call`) get 400 from
`unsupported_field`. Accepted and unused, since they change no output: `user`; on chat
`metadata`, `store` (braid stores nothing), `service_tier`, `prompt_cache_key`,
`prompt_cache_retention`, `prompt_cache_options` and a text part's `prompt_cache_breakpoint`
(the prefix cache needs no hints), `safety_identifier`, `reasoning_effort` and `verbosity`
(hints to a reasoning model), `modalities: ["text"]`, `function_call: "none"`, and
`stream_options.include_obfuscation` (braid pads no stream events).
Fields are strict JSON types: no bool for a number, no number in a string, no fraction for
an integer (a JSON integer is a float). Tool names follow OpenAI's rule (1 to 64 letters,
digits, "_" or "-", unique within `tools`); `logit_bias` keys are token ids in ASCII digits.
Structured output comes as OpenAI's `response_format` or vLLM's `structured_outputs`.
`prediction` (OpenAI's Predicted Outputs) drafts where speculation is on and changes nothing
where it is off (chat and completions alike).
Text that cannot be UTF-8 (a lone surrogate such as "\ud800") is refused where it enters,
in any string or key of a JSON value too (a tool's parameters, chat_template_kwargs).
Responses carry one extra field, `braid`: per-response speculation figures and preemptions.
"""

from __future__ import annotations

import re
import secrets
import time
import types
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from braid.messages import ChatMessage, JsonObject, Text, TextPart, ToolName


def _takes_null(annotation: Any) -> bool:
    return annotation is Any or annotation is None or type(None) in get_args(annotation) or any(
        _takes_null(a) for a in get_args(annotation) if isinstance(a, types.UnionType))


class Options(BaseModel):
    """A request body or part: `null` for a field that takes no null is its default, as vLLM
    (whose fields are Optional) and OpenAI take it: clients send unset options as null."""

    model_config = ConfigDict(strict=True)

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
    include_obfuscation: bool = True  # OpenAI's padding of stream events: accepted, none sent


class StructuredOutputsRequest(Options):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: JsonObject | Text | None = Field(None, alias="json")
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
    schema_: JsonObject = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Options):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class PredictedOutput(BaseModel):
    """OpenAI's Predicted Outputs: the text the reply is expected to be (a file to edit,
    say); with speculation on, its tokens are drafts the model verifies."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["content"]
    content: Text | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingRequest(Options):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Python's JSON reader takes NaN and Infinity, and pydantic the strings "nan" and "inf":
    # none is a sampling parameter
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: Text | None = None
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
    user: Text | None = None  # accepted, unused
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    prediction: PredictedOutput | None = None
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
        """logit_bias with integer token ids (ValueError naming the field otherwise). A key
        is ASCII digits only: int() would also take " 7", "1_0" and other scripts' digits."""
        if self.logit_bias is None:
            return None
        bad = [token for token in self.logit_bias if not _TOKEN_ID.fullmatch(token)]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids (ASCII digits), got "
                             f"{ascii(bad[0][:40])}")
        return {int(token): bias for token, bias in self.logit_bias.items()}


_TOKEN_ID = re.compile(r"[0-9]{1,18}")  # re's \d would take other scripts' digits too


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



class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: ToolName
    description: Text | None = None
    parameters: JsonObject | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # accepted; required and named choices always obey the schema


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"] = "function"
    function: FunctionDefinition


def _unique_names(tools: list[ToolDefinition]) -> list[ToolDefinition]:
    names = [t.function.name for t in tools]
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise ValueError(f"tool names must be unique; {twice!r} is given twice")
    return tools


Tools = Annotated[list[ToolDefinition], AfterValidator(_unique_names)]


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: ToolName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

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
    chat_template_kwargs: JsonObject | None = None
    add_special_tokens: bool = False  # the template writes them
    echo: bool = False  # vLLM's: the last message's content leads the reply (a prefill)
    documents: list[dict[Text, Text]] | None = None  # for a RAG template, as vLLM passes them
    tools: Tools | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's bookkeeping, routing and caching hints, accepted and unused: none changes the
    # output (braid stores no completion, and its prefix cache needs no key)
    metadata: dict[Text, Text] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    prompt_cache_options: JsonObject | None = None
    safety_identifier: Text | None = None
    # hints to a reasoning model (braid's models do not reason)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] \
        | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # OpenAI's that braid does not do: accepted only as their defaults (`unsupported_field`)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: JsonObject | None = None
    web_search_options: JsonObject | None = None
    moderation: JsonObject | None = None
    functions: list[JsonObject] | None = None
    function_call: Literal["none", "auto"] | JsonObject | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities", 'braid writes text only: modalities may be ["text"]'
        for name, why in (("audio", "audio output is not supported"),
                          ("web_search_options", "web search is not supported"),
                          ("moderation", "moderation is not supported")):
            if getattr(self, name) is not None:
                return name, why
        if self.functions:
            return "functions", "deprecated function calling is not supported; use tools"
        if self.function_call not in (None, "none"):
            return "function_call", ("deprecated function calling is not supported; use "
                                     "tool_choice")
        return super().unsupported_field()


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(BaseModel):
    # drafts from the request's `prediction` the model verified and took, or did not
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # with a prediction


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
    # with --reasoning-parser: the model's thinking (None where it did not think)
    reasoning_content: str | None = None
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
    reasoning_content: str | None = None
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

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Options):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: JsonObject | None = None
    add_special_tokens: bool = False
    tools: Tools | None = None
    documents: list[dict[Text, Text]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: the vocabulary's spellings


class DetokenizeRequest(Options):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None  # OpenAI's: a string naming the case, or null


class ErrorResponse(BaseModel):
    error: ErrorInfo
