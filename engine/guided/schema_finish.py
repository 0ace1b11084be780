"""After merging: what xgrammar would read differently in a schema, rewritten or turned into
an end check (a (pointer, keyword) the finished document is validated against): `enum` beside
other keywords, the string keywords it enforces one of, required names it would not require,
false and forbidden properties, booleans in prefixItems, typed keywords without a type; and
the last pass over the finished tree that keeps an open object's additional keys apart from
its declared names."""

from __future__ import annotations

import math
import re
from typing import Any

from engine.guided.patterns import excluded_words, merge_patterns, none_of, python_regex
from engine.guided.schema_types import (
    ALL_TYPES,
    Schema,
    UnsupportedSchema,
    escape_pointer,
    type_set,
)

TYPED_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems"),
    "object": (
        "properties",
        "patternProperties",
        "additionalProperties",
        "propertyNames",
        "required",
        "minProperties",
        "maxProperties",
    ),
}


class Finisher:
    """`defs` (the generated definitions so far, shared) lets `enum` values be checked against
    schemas that reference them; `end_checks` collects what decoding does not enforce."""

    def __init__(self, defs: dict[str, Schema | None], end_checks: list[tuple[str, str]]) -> None:
        self.defs = defs
        self.end_checks = end_checks

    def finish(self, schema: Schema, ptr: str) -> Schema:
        if isinstance(schema, bool) or "anyOf" in schema or "$ref" in schema:
            return schema
        out = dict(schema)
        if "enum" in out:
            return self._enum(out, ptr)
        if out.get("uniqueItems") is True:
            self.end_checks.append((ptr, "uniqueItems"))
        out.pop("uniqueItems", None)
        self._string(out, ptr)
        if not self._object(out, ptr) or not self._array(out):
            return False
        if "type" not in out and any(k in out for ks in TYPED_KEYWORDS.values() for k in ks):
            out["type"] = list(ALL_TYPES)  # xgrammar applies typed keywords only when typed
        types = type_set(out.get("type"))
        if "multipleOf" in out and ("number" in types or not types):
            if not _integral(out["multipleOf"]):
                raise UnsupportedSchema(ptr, "multipleOf", "multipleOf on numbers")
            out["type"] = [t for t in out.get("type", ALL_TYPES) if t != "number"]
            if "integer" not in out["type"]:
                out["type"].append("integer")
        if types == {"integer"}:
            _integer_bounds(out)
        return out

    def _enum(self, out: dict[str, Any], ptr: str) -> Schema:
        """xgrammar reads enum alone: keep the values the other keywords allow."""
        import jsonschema
        from referencing.exceptions import Unresolvable

        rest = {k: v for k, v in out.items() if k != "enum"}
        if self.defs:
            rest["$defs"] = {n: as_dict(d) for n, d in self.defs.items() if d is not None}
        validator = jsonschema.Draft202012Validator(rest, format_checker=jsonschema.FormatChecker())
        try:
            values = [v for v in out["enum"] if validator.is_valid(v)]
        except Unresolvable:
            raise UnsupportedSchema(ptr, "enum", "enum beside a recursive reference") from None
        if not values:
            return False
        return {"enum": values}

    def _string(self, out: dict[str, Any], ptr: str) -> None:
        """xgrammar enforces one of pattern, format and lengths on a string (a pattern wins
        over the others): the ones it would ignore are end checks."""
        ignored = ["format"] if "pattern" in out and "format" in out else []
        if "pattern" in out or "format" in out:
            ignored += [k for k in ("minLength", "maxLength") if k in out]
        for key in ignored:
            self.end_checks.append((ptr, key))
            del out[key]

    def _object(self, out: dict[str, Any], ptr: str) -> bool:
        """Required names xgrammar would not require unless listed; false properties, and
        properties propertyNames forbids. False when no object can satisfy it (then the
        schema accepts only other types)."""
        props: dict[str, Schema] = dict(out.get("properties", {}))
        closed = out.get("additionalProperties") is False and "patternProperties" not in out
        names = out.get("propertyNames", True)
        satisfiable = True
        for name in out.get("required", []):
            if name not in props:
                if closed:
                    satisfiable = False
                elif "patternProperties" in out:
                    raise UnsupportedSchema(
                        ptr, "required", f"required {name!r} beside patternProperties"
                    )
                else:
                    props[name] = out.get("additionalProperties", True)
        for name in props:
            if _name_allowed(names, name) is False:
                props[name] = False
        if any(props.get(name) is False for name in out.get("required", [])):
            satisfiable = False
        forbidden = [name for name, sub in props.items() if sub is False]
        for name in forbidden:
            del props[name]
        if forbidden and satisfiable and not closed:
            if "patternProperties" in out:
                raise UnsupportedSchema(
                    f"{ptr}/properties", forbidden[0], "a false property beside patternProperties"
                )
            out["propertyNames"] = self._forbid_names(names, forbidden, f"{ptr}/propertyNames")
        if "properties" in out or props:
            out["properties"] = props
        if satisfiable:
            return True
        return _without_type(out, "object")

    def _array(self, out: dict[str, Any]) -> bool:
        """xgrammar takes no booleans in prefixItems: true is {}, and a false item ends the
        array there; strict mode reads a missing `items` as false, which no array of
        minItems could satisfy. False when no array can satisfy it (then only other types)."""
        prefix = out.get("prefixItems")
        if "items" not in out and out.get("minItems", 0) > len(prefix or ()):
            out["items"] = {}  # strict mode reads a missing items as false: no array could be
        if prefix is None:
            return True
        if False in prefix:
            end = prefix.index(False)
            if out.get("minItems", 0) > end:
                return _without_type(out, "array")
            prefix = prefix[:end]
            out["maxItems"] = min(out.get("maxItems", end), end)
        out["prefixItems"] = [{} if item is True else item for item in prefix]
        return True

    def _forbid_names(self, names: Schema, forbidden: list[str], ptr: str) -> Schema:
        """propertyNames that also rejects these names (xgrammar cannot forbid a property of
        an open object any other way)."""
        if names is True:
            return {"type": "string", "pattern": none_of(forbidden)}
        if names is False or "anyOf" in names or "$ref" in names:
            raise UnsupportedSchema(ptr, "", "forbidding property names beside this propertyNames")
        out = dict(names)
        if "enum" in out:
            out["enum"] = [v for v in out["enum"] if v not in forbidden]
            return out if out["enum"] else False
        out["pattern"] = merge_patterns(out.get("pattern"), none_of(forbidden), ptr)
        result = self.finish(out, ptr)
        return result

    def named_keys_apart(self, schema: Schema, ptr: str) -> None:
        """xgrammar lets an open object's additional keys take any name its propertyNames
        allows, the declared properties' names included, so {"a": "x"} passes a declared
        integer "a": exclude the declared names, or leave it to the end check."""
        for sub, sub_ptr in _subschemas(schema, ptr):
            self.named_keys_apart(sub, sub_ptr)
        if not isinstance(schema, dict) or not isinstance(schema.get("propertyNames"), dict):
            return
        named = list(schema.get("properties", {}))
        if not named or schema.get("additionalProperties") is False:
            return
        names = schema["propertyNames"]
        if "enum" in names:
            names["enum"] = [v for v in names["enum"] if v not in named]
            if not names["enum"]:
                del schema["propertyNames"]
                schema["additionalProperties"] = False
            return
        pattern = names.get("pattern")
        if pattern is None or excluded_words(pattern) is not None:
            names["pattern"] = merge_patterns(pattern, none_of(named), f"{ptr}/propertyNames")
            self._string(names, f"{ptr}/propertyNames")
        elif any(re.fullmatch(python_regex(pattern), name) for name in named):
            self.end_checks.append((ptr, "propertyNames"))


def _without_type(out: dict[str, Any], kind: str) -> bool:
    """Drop a type none of whose values can satisfy the schema; False if no type is left."""
    types = type_set(out.get("type")) or set(ALL_TYPES)
    if types <= {kind}:
        return False
    out["type"] = [t for t in out.get("type", ALL_TYPES) if t != kind]
    for key in TYPED_KEYWORDS[kind]:
        out.pop(key, None)
    return True


def _subschemas(schema: Schema, ptr: str) -> list[tuple[Schema, str]]:
    if not isinstance(schema, dict):
        return []
    found: list[tuple[Schema, str]] = []
    for key in ("properties", "patternProperties", "$defs"):
        for name, sub in schema.get(key, {}).items():
            found.append((sub, f"{ptr}/{key}/{escape_pointer(name)}"))
    for key in ("anyOf", "prefixItems"):
        found += [(sub, f"{ptr}/{key}/{i}") for i, sub in enumerate(schema.get(key, []))]
    for key in ("items", "additionalProperties"):
        if key in schema:
            found.append((schema[key], f"{ptr}/{key}"))
    return found


def _name_allowed(names: Schema, name: str) -> bool | None:
    """Does propertyNames allow this name? None when not decidable here."""
    if isinstance(names, bool):
        return names
    if "anyOf" in names or "$ref" in names:
        return None
    if "enum" in names:
        return name in names["enum"]
    if "pattern" in names and not re.fullmatch(python_regex(names["pattern"]), name):
        return False
    min_length: int = names.get("minLength", 0)
    max_length: int = names.get("maxLength", len(name))
    return min_length <= len(name) <= max_length


def as_dict(schema: Schema | None) -> dict[str, Any]:
    if schema is True or schema is None:
        return {}
    if schema is False:
        return {"not": {}}  # unreachable: references to false targets are inlined
    return schema


def _integral(value: Any) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _integer_bounds(out: dict[str, Any]) -> None:
    """xgrammar wants whole-number bounds on integers: round inward."""
    for key, rounding in (
        ("minimum", math.ceil),
        ("maximum", math.floor),
        ("exclusiveMinimum", math.floor),
        ("exclusiveMaximum", math.ceil),
    ):
        if isinstance(out.get(key), float) and math.isfinite(out[key]):
            out[key] = int(rounding(out[key]))
