"""Rewrite a JSON schema into one xgrammar 0.2.9 enforces in full, or refuse it by pointer.

xgrammar silently ignores much of JSON Schema (found by experiment, pinned in
tests/engine/guided/test_json_schema.py): `allOf` of several schemas, keywords beside `anyOf` or
`$ref`, `enum`/`const` beside other keywords, `required` names missing from `properties`,
keywords of one type on a schema without `type`, `uniqueItems`, `contains`, `not`,
`if/then/else`, `dependent*`, `unevaluatedProperties`, `multipleOf` on numbers, and
lookaheads in patterns (a warning, then the pattern without them). `normalize_schema` turns
a schema into the subset it does enforce:

- internal `$ref`s become references into a generated `$defs` (each target normalized
  once, so recursion stays recursion); a `$ref` with sibling keywords is merged with its
  target (safe in every draft: where the draft ignores the siblings the result is only
  stricter);
- `allOf`, and keywords beside `anyOf`, are merged into one schema per branch, with the
  semantics a validator has: `additionalProperties: false` in one part forbids the
  properties only another part names;
- `oneOf` becomes `anyOf`, exact when the branches are provably disjoint, else with an end
  check; `uniqueItems` is an end check;
- `enum`/`const` keep the values their sibling keywords allow; draft-04 forms
  (`items: [...]`, boolean `exclusiveMinimum`) become their 2020-12 forms;
- `not S` becomes the complement of S (engine/guided/negation.py), `if/then/else` becomes
  `(if and then) or (not if and else)`, and each dependency `(no such property) or (what it
  needs)`, merged like `allOf`: applied in every draft, so only stricter where a draft
  ignores them;
- a property an open object forbids (`false`, or outside `propertyNames`) becomes a
  propertyNames pattern that excludes its name, and the declared properties are excluded
  from the additional keys' names (xgrammar lets `{"a": "x"}` through a declared integer
  `a` once propertyNames is set);
- of `pattern`, `format` and the length bounds xgrammar enforces one per string (the
  pattern first): the rest are end checks; `(...)?` in patterns is written `(...){0,1}`,
  which xgrammar reads correctly.

What cannot be rewritten is refused with UnsupportedSchema, naming the JSON pointer and the
keyword. An end check is a (pointer, keyword) decoding does not enforce: the finished
document must be validated (the gateway validates every guided output with jsonschema).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.guided.negation import Negator
from engine.guided.patterns import (
    full_match,
    python_regex,
)
from engine.guided.schema_finish import Finisher, as_dict
from engine.guided.schema_merge import Merger, json_equal, merge_types
from engine.guided.schema_refs import References
from engine.guided.schema_types import (
    ALL_TYPES,
    Schema,
    UnsupportedSchema,
    escape_pointer,
    type_set,
    union,
)

__all__ = [
    "NormalizedSchema",
    "UnsupportedSchema",
    "escape_pointer",
    "normalize_schema",
    "python_regex",
]

# Keywords refused wherever they appear: xgrammar ignores them and nothing here rewrites them.
REFUSED_KEYWORDS = {
    "contains": "contains",
    "minContains": "contains",
    "maxContains": "contains",
    "unevaluatedProperties": "unevaluatedProperties",
    "unevaluatedItems": "unevaluatedItems",
    "$dynamicRef": "$dynamicRef",
    "$recursiveRef": "$recursiveRef",
}
# Kept as they are (after checks): xgrammar enforces them on the types they apply to.
_SCALAR_KEYWORDS = (
    "type",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
    "uniqueItems",
)


@dataclass(frozen=True, slots=True)
class NormalizedSchema:
    """The schema xgrammar gets, and the (JSON pointer, keyword) pairs it does not enforce
    that a validator must check on the finished document."""

    schema: dict[str, Any]
    end_checks: tuple[tuple[str, str], ...]


def normalize_schema(schema: dict[str, Any]) -> NormalizedSchema:
    """The schema xgrammar enforces in full, with its end checks; raises UnsupportedSchema."""
    return _Normalizer(schema).run()


class _Normalizer:
    """The walk over the schema (`node`), and the three parts it leans on: references
    (schema_refs), merging (schema_merge) and finishing (schema_finish); negation
    (negation) is built from those."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.end_checks: list[tuple[str, str]] = []
        self.refs = References(root, self.node)
        self.finisher = Finisher(self.refs.defs, self.end_checks)
        self.merger = Merger(self.refs.deref, self.finisher.finish)
        self.deref = self.refs.deref
        self.finish = self.finisher.finish
        self.merge = self.merger.merge
        self.negator = Negator(self.deref, self.finish, self.merge)

    def run(self) -> NormalizedSchema:
        out = self.node(self.root, "")
        if out is False:
            raise UnsupportedSchema("", "", "the schema accepts no value")
        schema = {} if out is True else dict(out)
        defs = self.refs.defs
        used = _references(schema, defs)
        if used:
            schema["$defs"] = {name: as_dict(defs[name]) for name in used}
        schema = copy.deepcopy(schema)  # the last pass edits in place; targets are shared
        self.finisher.named_keys_apart(schema, "")
        return NormalizedSchema(schema, tuple(dict.fromkeys(self.end_checks)))

    # -- one node, children first ----------------------------------------------------------

    def node(self, schema: Any, ptr: str) -> Schema:
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, dict):
            return True
        for keyword, name in REFUSED_KEYWORDS.items():
            if keyword in schema:
                raise UnsupportedSchema(ptr, keyword, f"{name} cannot be enforced")
        out: dict[str, Any] = {k: schema[k] for k in _SCALAR_KEYWORDS if k in schema}
        self._draft4_bounds(schema, out)
        if "pattern" in out:
            out["pattern"] = full_match(out["pattern"], ptr, "pattern")
        if "const" in schema:
            out["enum"] = [schema["const"]]
        elif "enum" in schema:
            out["enum"] = list(schema["enum"])
        if isinstance(schema.get("properties"), dict):
            out["properties"] = {
                k: self.node(v, f"{ptr}/properties/{escape_pointer(k)}")
                for k, v in schema["properties"].items()
            }
        if isinstance(schema.get("patternProperties"), dict):
            out["patternProperties"] = {
                full_match(k, ptr, "patternProperties"): self.node(
                    v, f"{ptr}/patternProperties/{escape_pointer(k)}"
                )
                for k, v in schema["patternProperties"].items()
            }
        if "additionalProperties" in schema:
            out["additionalProperties"] = self.node(
                schema["additionalProperties"], f"{ptr}/additionalProperties"
            )
        if "propertyNames" in schema:  # names are strings: keep the string keywords' type
            names = self.node(schema["propertyNames"], f"{ptr}/propertyNames")
            out["propertyNames"] = self.merge({"type": "string"}, names, f"{ptr}/propertyNames")
        self._items(schema, out, ptr)
        parts: list[Schema] = []
        if "$ref" in schema:
            parts.append(self.refs.ref(schema["$ref"], ptr))
        if isinstance(schema.get("allOf"), list):
            parts += [self.node(s, f"{ptr}/allOf/{i}") for i, s in enumerate(schema["allOf"])]
        if isinstance(schema.get("anyOf"), list):
            parts.append(self.any_of(schema["anyOf"], f"{ptr}/anyOf"))
        if isinstance(schema.get("oneOf"), list):
            parts.append(self.one_of(schema["oneOf"], ptr))
        if "not" in schema:
            parts.append(self.negator.negate(self.node(schema["not"], f"{ptr}/not"), f"{ptr}/not"))
        if "if" in schema and ("then" in schema or "else" in schema):
            parts.append(self.conditional(schema, ptr))
        for keyword in ("dependencies", "dependentRequired", "dependentSchemas"):
            if isinstance(schema.get(keyword), dict):
                parts += [
                    self.dependency(name, dep, f"{ptr}/{keyword}/{escape_pointer(name)}")
                    for name, dep in schema[keyword].items()
                ]
        if len(parts) == 1 and not out:
            return parts[0]  # a bare $ref, allOf of one, anyOf or oneOf: nothing to merge
        result: Schema = self.finish(out, ptr) if out else True
        for part in parts:
            result = self.merge(result, part, ptr)
        return result

    def _draft4_bounds(self, schema: dict[str, Any], out: dict[str, Any]) -> None:
        for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(schema.get(exclusive), bool):
                del out[exclusive]
                if schema[exclusive] and bound in out:
                    out[exclusive] = out.pop(bound)

    def _items(self, schema: dict[str, Any], out: dict[str, Any], ptr: str) -> None:
        items = schema.get("items")
        if isinstance(items, list):  # draft-04 tuple form
            out["prefixItems"] = [self.node(s, f"{ptr}/items/{i}") for i, s in enumerate(items)]
            if "additionalItems" in schema:
                out["items"] = self.node(schema["additionalItems"], f"{ptr}/additionalItems")
        else:
            if isinstance(schema.get("prefixItems"), list):
                out["prefixItems"] = [
                    self.node(s, f"{ptr}/prefixItems/{i}")
                    for i, s in enumerate(schema["prefixItems"])
                ]
            if "items" in schema:
                out["items"] = self.node(items, f"{ptr}/items")

    def any_of(self, branches: list[Any], ptr: str) -> Schema:
        # Every branch normalized (and refused if it must be) before any is dropped.
        return union([self.node(s, f"{ptr}/{i}") for i, s in enumerate(branches)])

    def one_of(self, branches: list[Any], ptr: str) -> Schema:
        """anyOf, exact when no two branches can match one value, else with an end check."""
        kept = [
            b
            for i, s in enumerate(branches)
            if (b := self.node(s, f"{ptr}/oneOf/{i}")) is not False
        ]
        if not kept:
            return False
        if len(kept) == 1:
            return kept[0]
        resolved = [self.deref(b) for b in kept]
        if not all(_disjoint(a, b, self.deref) for a, b in itertools.combinations(resolved, 2)):
            self.end_checks.append((ptr, "oneOf"))
        return {"anyOf": kept}

    def conditional(self, schema: dict[str, Any], ptr: str) -> Schema:
        """if/then/else as (if and then) or (not if and else); without a then, if or else."""
        condition = self.node(schema["if"], f"{ptr}/if")
        then = self.node(schema.get("then", True), f"{ptr}/then")
        otherwise = self.node(schema.get("else", True), f"{ptr}/else")
        if "then" not in schema:
            return union([condition, otherwise])
        negated = self.negator.negate(condition, f"{ptr}/if")
        return union([self.merge(condition, then, ptr), self.merge(negated, otherwise, ptr)])

    def dependency(self, name: str, dependency: Any, ptr: str) -> Schema:
        """An object without the property, or one that satisfies what it depends on."""
        if isinstance(dependency, list):
            needed = self.finish({"type": "object", "required": list(dependency)}, ptr)
        else:
            needed = self.node(dependency, ptr)
        without = self.finish({"type": "object", "properties": {name: False}}, ptr)
        others = [t for t in ALL_TYPES if t != "object"]
        return union([{"type": others}, without, needed])


def _references(schema: dict[str, Any], defs: dict[str, Schema | None]) -> list[str]:
    """The generated $defs the schema reaches (merged-in targets leave unused ones)."""
    found: list[str] = []
    todo = [schema]
    while todo:
        for name in re.findall(r'"#/\$defs/(n\d+)"', json.dumps(todo.pop())):
            if name not in found:
                found.append(name)
                todo.append(as_dict(defs[name]))
    return sorted(found, key=lambda name: int(name[1:]))


def _disjoint(a: Schema, b: Schema, deref: Callable[[Schema], Schema]) -> bool:
    """Can no value satisfy both? True only when provable from the top-level keywords."""
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    ta, tb = type_set(a.get("type")), type_set(b.get("type"))
    if ta and tb and not merge_types(sorted(ta), sorted(tb)):
        return True
    if "enum" in a and "enum" in b:
        return not any(json_equal(x, y) for x in a["enum"] for y in b["enum"])
    for side, other in ((a, b), (b, a)):
        types = type_set(other.get("type"))
        if "enum" in side and types and not any(_has_type(v, types) for v in side["enum"]):
            return True
    props_a, props_b = a.get("properties", {}), b.get("properties", {})
    shared = set(a.get("required", [])) & set(b.get("required", []))
    for name in shared:
        pa, pb = deref(props_a.get(name, True)), deref(props_b.get(name, True))
        if isinstance(pa, dict) and isinstance(pb, dict) and _disjoint(pa, pb, deref):
            return True
    for side, other in ((a, b), (b, a)):
        if other.get("additionalProperties") is False and "patternProperties" not in other:
            allowed = other.get("properties", {})
            objects_only = {"object"} in (type_set(side.get("type")), type_set(other.get("type")))
            if objects_only and any(name not in allowed for name in side.get("required", [])):
                return True
    return False


def _has_type(value: Any, types: set[str]) -> bool:
    kind = _json_type(value)
    if kind == "integer" and "number" in types:
        return True
    if kind == "number" and "integer" in types and float(value).is_integer():
        return True
    return kind in types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
