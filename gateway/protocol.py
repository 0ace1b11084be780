"""OpenAI request bodies (pydantic) and their mapping to engine SamplingParams.

Unknown fields are ignored, as OpenAI does; wrong types fail validation (400).
vLLM's sampling extras (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens) and guided-decoding extras (guided_json, guided_regex,
guided_choice, guided_grammar) are accepted on both routes, as is
response_format.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.request import GuidedSpec, SamplingParams

GUIDED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class FieldError(ValueError):
    """A bad value in one named field (HTTP 400 with that `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` would shadow a BaseModel attribute.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None

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
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

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
