"""The complement of a normalized JSON schema, for `not`, `if`/`else` and dependencies.

xgrammar has no negation, so `not S` is rewritten into a schema it does enforce. A schema is
a conjunction of constraints (its type, its enum, each bound, each property), so by De
Morgan its complement is the union of the complements of its constraints, each taken among
the values the constraint applies to (`minLength: 3` constrains only strings, so its
complement is the strings of length 2 or less). What real schemas negate is the shape of an
`if`: a discriminating property's `const`/`enum`, `required`, a `type`. Constraints whose
complement xgrammar cannot express (a `pattern` we did not write, `format`, `multipleOf`,
`items`, `additionalProperties`, non-integral numbers) are refused by pointer.

Strings outside a finite set are written as a pattern by engine.guided.patterns.none_of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.guided.patterns import excluded_words, none_of
from engine.guided.schema_types import (
    ALL_TYPES,
    Schema,
    UnsupportedSchema,
    escape_pointer,
    type_set,
    union,
)


class Negator:
    """Complements of normalized schemas, built with the normalizer's own operations."""

    def __init__(
        self,
        deref: Callable[[Schema], Schema],
        finish: Callable[[Schema, str], Schema],
        merge: Callable[[Schema, Schema, str], Schema],
    ) -> None:
        self.deref = deref
        self.finish = finish
        self.merge = merge

    def negate(self, schema: Schema, ptr: str) -> Schema:
        schema = self.deref(schema)
        if isinstance(schema, bool):
            return not schema
        if "$ref" in schema:
            raise UnsupportedSchema(ptr, "", "negating a recursive schema")
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        branches: list[Schema] = [self._negate_constraints(rest, ptr)] if rest else []
        if "anyOf" in schema:  # not (A or B) = not A and not B
            both: Schema = True
            for option in schema["anyOf"]:
                both = self.merge(both, self.negate(option, ptr), ptr)
            branches.append(both)
        return union(branches)

    def _negate_constraints(self, schema: dict[str, Any], ptr: str) -> Schema:
        branches: list[Schema] = []
        for key, value in schema.items():
            negated = self._negate_one(key, value, schema, ptr)
            if negated is not False:
                branches.append(self.finish(negated, ptr) if isinstance(negated, dict) else True)
        return union(branches)

    def _negate_one(self, key: str, value: Any, schema: dict[str, Any], ptr: str) -> Schema:
        """The values the one constraint `key: value` rejects."""
        if key == "type":
            return _other_types(type_set(value), ptr)
        if key == "enum":
            return self._not_enum(value, ptr)
        if key == "properties":
            return union(self._property_fails(name, sub, ptr) for name, sub in value.items())
        if key == "required":
            return union(
                self.finish({"type": "object", "properties": {name: False}}, ptr) for name in value
            )
        flipped = _FLIPPED_BOUNDS.get(key)
        if flipped is not None:
            kind, other, shift = flipped
            bound = value + shift if shift else value
            if shift and bound < 0:
                return False  # e.g. maxLength -1: no value fails minLength 0
            return {"type": kind, other: bound}
        if key == "pattern" and (words := excluded_words(value)) is not None:
            return {"enum": sorted(words)}
        if key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            other = _NUMBER_BOUNDS[key]
            return {"type": "number", other: value}
        raise UnsupportedSchema(ptr, key, f"the complement of {key!r} cannot be enforced")

    def _property_fails(self, name: str, schema: Schema, ptr: str) -> Schema:
        negated = self.negate(schema, f"{ptr}/properties/{escape_pointer(name)}")
        if negated is False:
            return False
        return self.finish(
            {"type": "object", "required": [name], "properties": {name: negated}}, ptr
        )

    def _not_enum(self, values: list[Any], ptr: str) -> Schema:
        kinds = {_kind(v) for v in values}
        if kinds - {"string", "boolean", "null"}:
            raise UnsupportedSchema(
                ptr, "enum", "the complement of an enum of numbers, arrays or objects"
            )
        branches: list[Schema] = [{"type": [t for t in ALL_TYPES if t not in _KINDS & kinds]}]
        if "string" in kinds:
            strings = [v for v in values if isinstance(v, str)]
            branches.append({"type": "string", "pattern": none_of(strings)})
        if "boolean" in kinds:
            left = [b for b in (True, False) if b not in [v for v in values if isinstance(v, bool)]]
            if left:
                branches.append({"enum": left})
        return union(branches)


# A bound's complement: (the type it constrains, the opposite bound, the shift to it).
_FLIPPED_BOUNDS: dict[str, tuple[str, str, int]] = {
    "minLength": ("string", "maxLength", -1),
    "maxLength": ("string", "minLength", 1),
    "minItems": ("array", "maxItems", -1),
    "maxItems": ("array", "minItems", 1),
    "minProperties": ("object", "maxProperties", -1),
    "maxProperties": ("object", "minProperties", 1),
}
_NUMBER_BOUNDS = {
    "minimum": "exclusiveMaximum",
    "maximum": "exclusiveMinimum",
    "exclusiveMinimum": "maximum",
    "exclusiveMaximum": "minimum",
}
# Types whose values an enum can list completely for its complement to be expressible.
_KINDS = {"string", "boolean", "null"}


def _other_types(types: set[str], ptr: str) -> Schema:
    if "integer" in types and "number" not in types:
        raise UnsupportedSchema(
            ptr, "type", "the complement of type integer (numbers with a fraction)"
        )
    if "number" in types:
        types = types | {"integer"}
    rest = [t for t in ALL_TYPES if t not in types]
    return {"type": rest} if rest else False


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    return "other"
