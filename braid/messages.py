"""Chat messages as chat templates take them, validated strictly (pydantic): the server's
request bodies and `LLM.chat` read messages through the same models. Text that cannot be
UTF-8 (a lone surrogate such as "\ud800") is refused where it enters, in any string or key of
a JSON value too; tool names follow OpenAI's rule."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text must be valid UTF-8: {e.reason} at index {e.start}") from None
    return text


def _utf8_json(value: Any) -> Any:
    """`value` (parsed JSON), once every string and key in it is valid UTF-8 (walked with a
    stack: JSON may nest deeper than Python's recursion limit)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"text must be valid UTF-8: {e.reason} at index {e.start} "
                                 f"of {ascii(item[:40])}") from None
    return value


def _tool_name(name: str) -> str:
    if not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", name):
        raise ValueError("a tool name is 1 to 64 letters, digits, underscores or dashes "
                         "(OpenAI's rule)")
    return name


Text = Annotated[str, AfterValidator(_utf8)]
JsonValue = Annotated[Any, AfterValidator(_utf8_json)]
JsonObject = Annotated[dict[str, Any], AfterValidator(_utf8_json)]
ToolName = Annotated[str, AfterValidator(_tool_name)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"] = "text"
    text: Text
    prompt_cache_breakpoint: JsonObject | None = None  # OpenAI's caching hint: unused


class TemplatePart(BaseModel):
    """A part of a message that reaches the chat template as it came: fields beyond the
    known ones are passed along (a template may read them), their text checked too."""

    model_config = ConfigDict(extra="allow", strict=True)
    __pydantic_extra__: dict[str, JsonValue] = Field(init=False)


class CalledFunction(TemplatePart):
    name: Text
    arguments: Text | JsonObject  # JSON text, as OpenAI sends it (an object is taken too)


class MessageToolCall(TemplatePart):
    """A call an earlier assistant message made, as the client sends it back."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(TemplatePart):
    role: Text
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content is one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)  # as vLLM
        message.setdefault("content", "")
        return message
