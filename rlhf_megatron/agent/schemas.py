"""OpenAI function-calling schemas and the tool response, with verl's class and field names.

A verl tool imports these from ``verl.tools.schemas``; pointing that import here is the only change
it needs. The models validate the ``tool_schema`` entries of a tool config and the calls a model
writes. Boundaries: pydantic only; parsing the model's text is in ``calls``, running a call too.

Where verl's models reject something harmless they are looser here (``properties`` and
``required`` default to empty, a property may carry ``items``), so every config verl accepts is
accepted too.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

__all__ = [
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
]


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter of a function: its JSON type, a description for the model, allowed values."""

    type: str
    description: str | None = None
    enum: list[str] | None = None
    # The element schema of an ``array`` parameter; chat templates show it to the model.
    items: dict[str, Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """The parameters object of a function (``type: object``)."""

    type: str
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    """A function the model may call: name, description and parameters."""

    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[])
    )
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool in OpenAI format (``{"type": "function", "function": {...}}``), as chat templates take it."""

    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as parsed from the model's text: the arguments are still a JSON string."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    """A call with decoded arguments."""

    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(
        parsed_schema: OpenAIFunctionParsedSchema,
    ) -> tuple[OpenAIFunctionCallSchema, bool]:
        """Decode the arguments; ``(call with {} arguments, True)`` when they are not a JSON object."""
        try:
            arguments = json.loads(parsed_schema.arguments)
        except json.JSONDecodeError:
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments), False


class OpenAIFunctionToolCall(BaseModel):
    """A call with its id, as an assistant message's ``tool_calls`` entry."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool returns to the model: text and/or lists of images and videos."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _media_are_lists(cls, values: Any) -> Any:
        # A single image passed bare is the usual mistake; pydantic's own message would not say
        # that wrapping it in a list is the fix.
        if isinstance(values, dict):
            for key in ("image", "video"):
                if key in values and values[key] is not None and not isinstance(values[key], list):
                    raise ValueError(
                        f"ToolResponse.{key} must be a list, got {type(values[key]).__name__}; "
                        f"wrap a single {key} in a list: {key}=[item]."
                    )
        return values

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video
