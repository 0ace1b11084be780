"""Merging schemas (allOf, and the siblings of `$ref` and `anyOf`) into one exactly as strict
as both, with a validator's semantics: `additionalProperties: false` in one part forbids the
properties only another part names."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

from engine.guided.patterns import merge_patterns
from engine.guided.schema_types import (
    ALL_TYPES,
    Schema,
    UnsupportedSchema,
    escape_pointer,
    type_set,
    union,
)

MAX_BRANCHES = 64
MAX_MERGE_DEPTH = 32


class Merger:
    """`deref` resolves a generated reference; `finish` fixes up a merged schema."""

    def __init__(
        self, deref: Callable[[Schema], Schema], finish: Callable[[Schema, str], Schema]
    ) -> None:
        self.deref = deref
        self.finish = finish
        self.merge_depth = 0

    def merge(self, a: Schema, b: Schema, ptr: str) -> Schema:
        """A schema exactly as strict as both (the intersection), or UnsupportedSchema."""
        if a is True or b is False:
            return b
        if b is True or a is False:
            return a
        self.merge_depth += 1
        try:
            if self.merge_depth > MAX_MERGE_DEPTH:
                raise UnsupportedSchema(ptr, "allOf", "merging recursive schemas")
            a, b = self.deref(a), self.deref(b)
            if isinstance(a, bool) or isinstance(b, bool):
                return self.merge(a, b, ptr)
            for side in (a, b):
                if "$ref" in side:
                    raise UnsupportedSchema(
                        ptr, "$ref", "cannot merge a recursive reference with other keywords"
                    )
            if "anyOf" in a or "anyOf" in b:
                return self._merge_any_of(a, b, ptr)
            return self.finish(self._merge_keywords(a, b, ptr), ptr)
        finally:
            self.merge_depth -= 1

    def _merge_any_of(self, a: dict[str, Any], b: dict[str, Any], ptr: str) -> Schema:
        a_rest = {k: v for k, v in a.items() if k != "anyOf"}
        b_rest = {k: v for k, v in b.items() if k != "anyOf"}
        a_opts = a.get("anyOf", [True])
        b_opts = b.get("anyOf", [True])
        if len(a_opts) * len(b_opts) > MAX_BRANCHES:
            raise UnsupportedSchema(ptr, "anyOf", f"more than {MAX_BRANCHES} merged branches")
        rest = self.merge(a_rest or True, b_rest or True, ptr)
        return union(
            self.merge(rest, self.merge(x, y, ptr), ptr)
            for x, y in itertools.product(a_opts, b_opts)
        )

    def _merge_keywords(self, a: dict[str, Any], b: dict[str, Any], ptr: str) -> Schema:
        out = {k: v for k, v in a.items() if k not in b}
        out.update({k: v for k, v in b.items() if k not in a})
        for key in set(a) & set(b):
            x, y = a[key], b[key]
            if key == "type":
                out[key] = merge_types(x, y)
                if not out[key]:
                    return False
            elif key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
                out[key] = max(x, y)
            elif key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
                out[key] = min(x, y)
            elif key == "required":
                out[key] = list(dict.fromkeys(x + y))
            elif key == "uniqueItems":
                out[key] = x or y
            elif key == "enum":
                out[key] = [v for v in x if any(json_equal(v, w) for w in y)]
            elif key == "pattern":
                out[key] = merge_patterns(x, y, ptr)
            elif key == "multipleOf":
                big, small = max(x, y), min(x, y)
                if big % small != 0:
                    raise UnsupportedSchema(ptr, key, f"merging multipleOf {x} and {y}")
                out[key] = big
            elif key in ("additionalProperties", "propertyNames", "items"):
                out[key] = self.merge(x, y, f"{ptr}/{key}")
            elif key in ("properties", "prefixItems", "patternProperties"):
                pass  # below, with what they depend on
            elif not json_equal(x, y):
                raise UnsupportedSchema(ptr, key, f"merging two different {key}s ({x!r}, {y!r})")
        if "properties" in a or "properties" in b or "additionalProperties" in out:
            self._merge_properties(a, b, out, ptr)
        if "prefixItems" in a or "prefixItems" in b:
            length = max(len(a.get("prefixItems", [])), len(b.get("prefixItems", [])))
            out["prefixItems"] = [
                self.merge(_item(a, i), _item(b, i), f"{ptr}/prefixItems/{i}")
                for i in range(length)
            ]
        return out

    def _merge_properties(
        self, a: dict[str, Any], b: dict[str, Any], out: dict[str, Any], ptr: str
    ) -> None:
        if (
            "patternProperties" in a
            and ("properties" in b or "additionalProperties" in b)
            or ("patternProperties" in b and ("properties" in a or "additionalProperties" in a))
        ):
            raise UnsupportedSchema(ptr, "patternProperties", "merging patternProperties")
        names = list(dict.fromkeys([*a.get("properties", {}), *b.get("properties", {})]))
        out["properties"] = {
            k: self.merge(_property(a, k), _property(b, k), f"{ptr}/properties/{escape_pointer(k)}")
            for k in names
        }


def _property(schema: dict[str, Any], name: str) -> Schema:
    props: dict[str, Schema] = schema.get("properties", {})
    if name in props:
        return props[name]
    additional: Schema = schema.get("additionalProperties", True)
    return additional


def _item(schema: dict[str, Any], index: int) -> Schema:
    prefix: list[Schema] = schema.get("prefixItems", [])
    if index < len(prefix):
        return prefix[index]
    items: Schema = schema.get("items", True)
    return items


def merge_types(x: Any, y: Any) -> list[str]:
    a, b = type_set(x), type_set(y)
    both = a & b
    if "integer" in a and "number" in b or "number" in a and "integer" in b:
        both.add("integer")
    return [t for t in ALL_TYPES if t in both]


def json_equal(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) and (type(a) is bool) == (
        type(b) is bool
    )
