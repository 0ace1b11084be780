"""The safety net under guided JSON: every finished document is checked against its schema.

The grammar is the mechanism (engine.guided): a document it finishes should always be valid.
This module is the net for what it does not enforce (a bug, a keyword it lets through): a
document that fails here is answered with `finish_reason: "error"` and the reason, never as if
it were valid. The check is the `jsonschema` library with the schema's own draft
(`validator_for`) and that draft's format checker, with patterns read as ECMA-262 (named
groups `(?<n>...)`, which Python's `re` refuses); compiled validators are kept per schema (its
canonical JSON) in a small LRU.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jsonschema.exceptions import ValidationError, relevance
from jsonschema.protocols import Validator
from jsonschema.validators import Draft202012Validator, extend, validator_for

from engine.guided.patterns import python_regex
from engine.request import GuidedSpec

logger = logging.getLogger(__name__)

# Documents longer than this (characters) are checked on a worker thread, off the event loop.
OFFLOAD_CHARS = 32 * 1024
CACHE_SIZE = 64
# Errors looked at to pick the most relevant one: a document far off the schema has many.
MAX_ERRORS = 16
MAX_MESSAGE_CHARS = 512
NOT_JSON = "json"  # the keyword of a document that does not parse
_JSON_TYPES = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


@dataclass(frozen=True, slots=True)
class Violation:
    """Why a finished document is not one of its schema."""

    keyword: str  # the failing JSON Schema keyword (uniqueItems, format, ...) or `json`
    pointer: str  # JSON pointer into the document ("" is the whole document)
    schema_pointer: str  # JSON pointer of the failing keyword in the schema
    message: str

    def body(self) -> dict[str, Any]:
        """The error object beside a choice whose document failed (OpenAI's error shape)."""
        return {
            "message": self.message,
            "type": "invalid_output",
            "param": None,
            "code": "schema_validation_failed",
        }


def checks(spec: GuidedSpec | None) -> bool:
    """Whether a spec's outputs are validated: a JSON schema, or any JSON object."""
    return spec is not None and (spec.json_schema is not None or spec.json_object)


def _pointer(parts: Any) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _shorten(text: str) -> str:
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[: MAX_MESSAGE_CHARS - 3] + "..."


class OutputValidator:
    """Validates finished guided documents; one per server (its LRU is shared)."""

    def __init__(self, cache_size: int = CACHE_SIZE, offload_chars: int = OFFLOAD_CHARS) -> None:
        self.cache_size = cache_size
        self.offload_chars = offload_chars
        self._validators: OrderedDict[str, Validator] = OrderedDict()

    async def check(self, spec: GuidedSpec, text: str) -> Violation | None:
        """`validate`, on a worker thread when the document is large."""
        if len(text) > self.offload_chars:
            return await asyncio.to_thread(self.validate, spec, text)
        return self.validate(spec, text)

    def validate(self, spec: GuidedSpec, text: str) -> Violation | None:
        """None if `text` is a document of the spec (a JSON schema, or any JSON object)."""
        try:
            document = json.loads(text, parse_constant=_no_constant)
        except ValueError as exc:
            return Violation(NOT_JSON, "", "", _shorten(f"the output is not valid JSON: {exc}"))
        if spec.json_schema is None:
            if isinstance(document, dict):
                return None
            kind = _JSON_TYPES.get(type(document), "value")
            return Violation("type", "", "", f"the output is a JSON {kind}, not an object")
        validator = self._validator(spec.json_schema)
        try:
            errors = list(itertools.islice(validator.iter_errors(document), MAX_ERRORS))
        except Exception:  # noqa: BLE001 - the checker itself failed (a regex `re` rejects, ...)
            logger.exception("could not validate a guided output against its schema")
            return None
        if not errors:
            return None
        return _violation(max(errors, key=relevance))

    def _validator(self, schema: dict[str, Any]) -> Validator:
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        validator = self._validators.get(key)
        if validator is not None:
            self._validators.move_to_end(key)
            return validator
        validator = schema_validator(schema)
        self._validators[key] = validator
        if len(self._validators) > self.cache_size:
            self._validators.popitem(last=False)
        return validator


def schema_validator(schema: dict[str, Any]) -> Validator:
    """A validator of the schema's own draft (2020-12 if it names none), with its format
    checker and ECMA-262 patterns."""
    cls = validator_for(schema, default=Draft202012Validator)
    ecma = extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties})
    return ecma(schema, format_checker=cls.FORMAT_CHECKER)


def _search(pattern: str, text: str) -> bool:
    return re.search(python_regex(pattern), text) is not None


def _pattern(
    validator: Validator, pattern: str, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(
    validator: Validator, patterns: dict[str, Any], instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for name, value in instance.items():
            if _search(pattern, name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _violation(error: ValidationError) -> Violation:
    keyword = str(error.validator)
    pointer = _pointer(error.absolute_path)
    schema_pointer = _pointer(error.absolute_schema_path)
    message = (
        f"the output does not match the schema: {keyword} failed at {pointer or '/'}"
        f" (schema {schema_pointer}): {error.message}"
    )
    return Violation(keyword, pointer, schema_pointer, _shorten(message))
