"""OpenAI request bodies (pydantic) and their mapping to engine SamplingParams.

Unknown fields are ignored, as OpenAI does; wrong types fail validation (400).
vLLM's sampling extras (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens) and guided-decoding extras (guided_json, guided_regex,
guided_choice, guided_grammar) are accepted on both routes, as is
response_format.

Every field is bounded here, so that no request can ask the engine for what it
cannot represent or afford (docs/failure-isolation.md, "Request bounds"). Bounds that depend on the
model or the server's settings (the vocabulary, `--max-n`, `--max-prompt-chars`,
the context length) are checked by gateway.openai.serving; JSON itself (non-finite
numbers, nesting, lone surrogates) by gateway.http.edge.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.request import GuidedSpec, SamplingParams

GUIDED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)

INT32_MAX = 2**31 - 1
# A seed is an integer a JSON number holds exactly (a double: 53 bits), so that every
# client and schema validator agrees on the bound.
SEED_MIN, SEED_MAX = -(2**53), 2**53
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_PROMPTS = 128  # prompts in one completion request
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 256
MAX_NAME_CHARS = 256
MAX_PRIORITY = 1_000_000
MAX_GUIDED_CHOICES = 1024
MAX_LOGPROBS = 20
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # in one assistant message of the history
MAX_DESCRIPTION_CHARS = 4096

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
_PROMPTS = Field(min_length=1, max_length=MAX_PROMPTS)


class _Body(BaseModel):
    # Non-finite floats are refused by the JSON parser too (gateway.http.edge); this holds the
    # line for bodies built in Python.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class FieldError(ValueError):
    """A bad value in one named field (HTTP 400 with that `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = Field(None, max_length=4096)
    # `schema` would shadow a BaseModel attribute.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(_Body):
    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    # The server's --max-n is checked by gateway.openai.serving.
    n: int = Field(1, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # The bound on the list itself: on the union it also capped a single stop string at 16
    # characters and reached the published schema as a string's maxLength.
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # Token id (a JSON object's keys are strings) -> bias added to its logit.
    logit_bias: dict[TokenId, Bias] | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS,
        json_schema_extra={"propertyNames": {"pattern": "^(0|[1-9][0-9]{0,8})$"}},
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    # Requests that share a long prefix say so: a model's replicas route them together (the
    # key is joined to the tenant's cache salt, so it never joins two tenants).
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    # vLLM's: the request's band under --scheduling-policy fair or priority, lower first
    # (engine/priority.py). 0 is the best a tenant may ask for; batch lines run at
    # --batch-priority.
    priority: int = Field(0, ge=0, le=MAX_PRIORITY)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, max_length=MAX_GUIDED_CHOICES)
    guided_grammar: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming a bad value (HTTP 400); FieldError names its field."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        guided = self.guided_spec()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            guided=guided,
        )

    @property
    def guided_param(self) -> str | None:
        """The field that asks for guided decoding, if one does."""
        fields = self._guided_fields()
        return fields[0] if fields else None

    def guided_spec(self) -> GuidedSpec | None:
        fields = self._guided_fields()
        if not fields:
            return None
        if len(fields) > 1:
            raise FieldError(
                fields[1], f"{fields[0]} and {fields[1]} both ask for guided decoding; send one"
            )
        try:
            return self._guided_spec(fields[0])
        except ValueError as exc:
            raise FieldError(fields[0], str(exc)) from exc

    def _guided_fields(self) -> list[str]:
        fields = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            fields.remove("response_format")
        return fields

    def _guided_spec(self, param: str) -> GuidedSpec:
        if param == "guided_json":
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
            return GuidedSpec(json_schema=schema)
        if param == "guided_regex":
            return GuidedSpec(regex=self.guided_regex)
        if param == "guided_choice":
            return GuidedSpec(choice=tuple(self.guided_choice or ()))
        if param == "guided_grammar":
            return GuidedSpec(grammar=self.guided_grammar)
        assert self.response_format is not None
        if self.response_format.type == "json_object":
            return GuidedSpec(json_object=True)
        json_schema = self.response_format.json_schema
        if json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return GuidedSpec(
            json_schema=json_schema.json_schema, strict=json_schema.strict is not False
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    # Lengths in characters and tokens are the server's (gateway.openai.serving).
    prompt: str | TokenIds | Annotated[list[str], _PROMPTS] | Annotated[list[TokenIds], _PROMPTS]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TextPart(_Body):
    type: Literal["text"]
    text: str


# OpenAI's function names: letters, digits, underscores and dashes, at most 64.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]


class FunctionDefinition(_Body):
    name: FunctionName
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    # A JSON schema; its size and depth are the guided limits' (gateway.openai.serving compiles it).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Body):
    name: FunctionName
    arguments: str = Field(max_length=1 << 20)  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)  # assistant's
    tool_call_id: str | None = Field(None, max_length=MAX_NAME_CHARS)  # a tool message's

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
