"""The Responses API's request body (`POST /v1/responses`), bounded at the edge as chat's is,
and its conversation as a chat request: the gateway answers a response with the chat path
(templates, tools, grammars, admission, metering), so the two can never drift apart.

Input items (gateway.openai.responses.items) are kept in the Responses shape with ids; they
become chat messages only to run. Anything the API defines that a text model behind this
gateway cannot do (built-in tools, image, file or audio inputs, item references) is a 400
naming the field, never ignored.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, Field, GetJsonSchemaHandler, TypeAdapter
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from gateway.openai.protocol import (
    INT32_MAX,
    MAX_DESCRIPTION_CHARS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_TOOLS,
    ChatCompletionRequest,
    FieldError,
    FunctionName,
    JSONSchemaFormat,
    _SamplingFields,
)
from gateway.openai.responses.compaction_item import PREFIX
from gateway.openai.responses.items import (
    MAX_ARGUMENT_CHARS,
    MAX_ID_CHARS,
    Role,
    TextPartType,
    items_of,
)

MAX_METADATA_PAIRS = 16  # OpenAI's bounds on `metadata`
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
BUILT_IN_TOOLS = (
    "web_search",
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
)

# What `include` may ask for. Only the logprobs are something this server produces; the
# others name outputs of built-in tools and reasoning, which it never makes, so there is
# nothing to add for them (an agent framework sends them by habit).
LOGPROBS_INCLUDE = "message.output_text.logprobs"
Includable = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "web_search_call.action.sources",
    "web_search_call.results",
]
ServiceTier = Literal["auto", "default", "flex", "priority", "scale"]

Metadata = Annotated[
    dict[
        Annotated[str, Field(max_length=MAX_METADATA_KEY)],
        Annotated[str, Field(max_length=MAX_METADATA_VALUE)],
    ],
    Field(max_length=MAX_METADATA_PAIRS),
]


class ConversationRef(BaseModel):
    """`conversation` as an object (the SDK's ResponseConversationParam)."""

    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)


# -- what the OpenAPI document shows --------------------------------------------------------------
# `input`'s items, `tools`, `tool_choice` and `text` are checked by hand (input_item, chat_tools,
# chat_tool_choice, chat_response_format: a 400 naming the exact field, e.g.
# `input[0].content[1].type`), so they validate as plain dicts. The models below are their JSON
# schemas, and only that: each says what those checks (and the chat request a response runs
# as) accept, no more and no less, and schemathesis holds the two together
# (tests/gateway/test_schemathesis_cli.py). A change to a check changes its model here.


class ShownAs:
    """A field's JSON schema taken from `shape`, a type declared for the schema only; the
    field still validates as its own type."""

    def __init__(self, shape: Any) -> None:
        self.shape = TypeAdapter(shape).core_schema

    def __get_pydantic_json_schema__(
        self, _: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return handler(self.shape)


# An item's own id: given, or made when absent, null or empty.
ItemId = Annotated[str, Field(max_length=MAX_ID_CHARS)] | None
CallId = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
ItemText = Annotated[str, Field(max_length=MAX_ARGUMENT_CHARS)]


class InputTextPart(BaseModel):
    """A content part: the model reads its `text`, or, where that is empty, its `refusal`."""

    type: TextPartType
    text: str = ""
    refusal: str = ""


class EasyInputMessage(BaseModel):
    type: Literal["message"] = "message"
    role: Role
    content: str | list[InputTextPart]


class FunctionCallItem(BaseModel):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    id: ItemId = None
    call_id: CallId
    name: FunctionName  # what chat's template takes: a later turn replays the call
    arguments: ItemText


class FunctionCallOutputItem(BaseModel):
    """What a call returned."""

    type: Literal["function_call_output"]
    id: ItemId = None
    call_id: CallId
    # Content parts: their `text`, joined.
    output: ItemText | list[Any]


class CompactionItem(BaseModel):
    """The summary /v1/responses/compact made: only this server's content reads back."""

    type: Literal["compaction"]
    id: ItemId = None
    encrypted_content: Annotated[
        str, Field(max_length=MAX_ARGUMENT_CHARS, pattern=f"^{re.escape(PREFIX)}")
    ]


InputItem = Annotated[
    dict[str, Any],
    ShownAs(EasyInputMessage | FunctionCallItem | FunctionCallOutputItem | CompactionItem),
]
Input = str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]


class FunctionTool(BaseModel):
    """The only tool a response takes: built-in tools are refused by name."""

    type: Literal["function"]
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="null or absent: true")


class ToolChoiceFunction(BaseModel):
    type: Literal["function"]
    name: FunctionName


class ResponseFormatText(BaseModel):
    type: Literal["text"]


class ResponseFormatJsonObject(BaseModel):
    type: Literal["json_object"]


class TextResponseFormatJsonSchema(JSONSchemaFormat):
    type: Literal["json_schema"]


class ResponseTextParam(BaseModel):
    format: ResponseFormatText | ResponseFormatJsonObject | TextResponseFormatJsonSchema | None = (
        None
    )


class ResponseFields(_SamplingFields):
    """A response's fields but its input: OpenAI's, plus the sampling extras chat takes
    (top_k, min_p, seed, stop, ...)."""

    # A response has one output: any n but 1 is refused by check(), naming the field.
    n: Annotated[int, ShownAs(Literal[1])] = Field(1, ge=1, le=INT32_MAX)
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    # A conversation (gateway.openai.conversations): its items come before this turn's input,
    # and the turn is appended to it. Its id, or {"id": ...}.
    conversation: (
        Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)] | ConversationRef | None
    ) = None
    store: bool = True
    background: bool = False
    max_output_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    tools: list[Annotated[dict[str, Any], ShownAs(FunctionTool)]] | None = Field(
        None, max_length=MAX_TOOLS
    )
    tool_choice: (
        Literal["none", "auto", "required"]
        | Annotated[dict[str, Any], ShownAs(ToolChoiceFunction)]
        | None
    ) = None
    parallel_tool_calls: bool = True
    text: Annotated[dict[str, Any], ShownAs(ResponseTextParam)] | None = None
    metadata: Metadata | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    include: list[Includable] | None = Field(None, max_length=len(get_args(Includable)))
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Caps calls to built-in tools, which this server has none of: echoed, nothing to cap.
    max_tool_calls: int | None = Field(None, ge=1, le=2**31 - 1)
    # Every request runs in the one tier there is: the response says "default".
    service_tier: ServiceTier | None = None
    safety_identifier: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def check(self) -> None:
        """What the types cannot say. Raises FieldError naming the field."""
        if self.n != 1:
            raise FieldError("n", "a response has one output; n must be 1")
        if self.background and not self.store:
            raise FieldError("background", "background responses are stored: set store true")
        if self.background and self.stream:
            raise FieldError("stream", "a background response is polled, not streamed")
        if self.conversation is not None and self.previous_response_id is not None:
            raise FieldError(
                "conversation", "conversation and previous_response_id cannot both be given"
            )

    @property
    def conversation_id(self) -> str | None:
        """`conversation`'s id, however it was given."""
        given = self.conversation
        return given.id if isinstance(given, ConversationRef) else given

    def conversation_body(self) -> dict[str, Any]:
        """`conversation` as the response object echoes it: only when one was given."""
        given = self.conversation_id
        return {} if given is None else {"conversation": {"id": given}}

    @abstractmethod
    def input_items(self) -> list[dict[str, Any]]:
        """This turn's input as Responses items with ids. Raises FieldError."""

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                what = "a built-in tool" if kind in BUILT_IN_TOOLS else "a tool type"
                raise FieldError(
                    f"tools[{i}].type", f"{what} {kind!r} is not supported: only function tools"
                )
            description = tool.get("description")
            if description is not None and len(str(description)) > MAX_DESCRIPTION_CHARS:
                raise FieldError(f"tools[{i}].description", "the description is too long")
            function = {
                "name": tool.get("name"),
                "description": description,
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict", True),  # the Responses API's default
            }
            tools.append({"type": "function", "function": function})
        return tools

    def tools_body(self) -> list[dict[str, Any]]:
        """`tools` as the response object echoes them: each function tool whole, with the
        `strict` it ran under (a schema is enforced unless the tool says strict false)."""
        return [
            {
                "type": "function",
                "name": tool.get("name"),
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict") is not False,
            }
            for tool in self.tools or ()
        ]

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise FieldError(
                "tool_choice", "tool_choice is none, auto, required or a function by name"
            )
        return {"type": "function", "function": {"name": choice["name"]}}

    def chat_response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's response_format."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in ("text", "json_object"):
            return {"type": kind}
        if kind == "json_schema":
            schema = {
                "name": fmt.get("name"),
                "schema": fmt.get("schema"),
                "strict": fmt.get("strict"),
                "description": fmt.get("description"),
            }
            return {"type": "json_schema", "json_schema": schema}
        raise FieldError("text.format.type", "text.format is text, json_object or json_schema")

    def text_body(self) -> dict[str, Any]:
        """`text` as the response object echoes it: a json_schema format with every field
        the spec requires, `strict` as it ran (the schema is enforced unless strict false)."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            fmt = {
                "type": "json_schema",
                "name": fmt.get("name"),
                "description": fmt.get("description"),
                "schema": fmt.get("schema"),
                "strict": fmt.get("strict") is not False,
            }
        return {"format": fmt}

    def chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that answers this response over `messages`. Raises FieldError
        (a tool or format that chat refuses is named as this API names it)."""
        fields = self.model_dump(
            exclude={
                "input",
                "instructions",
                "previous_response_id",
                "conversation",
                "store",
                "background",
                "max_output_tokens",
                "tools",
                "tool_choice",
                "text",
                "metadata",
                "truncation",
                "stream",
                "stream_options",
                "include",
                "top_logprobs",
                "max_tool_calls",
                "service_tier",
                "safety_identifier",
            },
            exclude_none=True,
        )
        body = fields | {
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.chat_response_format() or fields.get("response_format"),
            "logprobs": self.wants_logprobs,
            "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
        }
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValueError as exc:
            raise FieldError("input", _first_error(exc)) from exc


class ResponsesRequest(ResponseFields):
    """`POST /v1/responses`."""

    input: Input

    def input_items(self) -> list[dict[str, Any]]:
        return items_of(self.input)


class InputTokensRequest(ResponseFields):
    """`POST /v1/responses/input_tokens`: a response's body, counted, not run. `input` may be
    left out where a conversation or a previous response says it all."""

    input: Input | None = None

    def input_items(self) -> list[dict[str, Any]]:
        return [] if self.input is None else items_of(self.input)


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        error = errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        return f"{where}: {error['msg']}"
    return str(exc)
