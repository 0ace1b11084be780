"""Rewrite a JSON schema into one xgrammar 0.2.9 enforces in full, or refuse it by pointer.

xgrammar silently ignores much of JSON Schema (found by experiment, pinned in
tests/engine/test_json_schema.py): `allOf` of several schemas, keywords beside `anyOf` or
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
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from engine.guided.negation import Negator
from engine.guided.patterns import (
    excluded_words,
    full_match,
    merge_patterns,
    none_of,
    python_regex,
)
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
_TYPED_KEYWORDS = {
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
_MAX_BRANCHES = 64
_MAX_MERGE_DEPTH = 32


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
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.names: dict[str, str] = {}  # ref target pointer -> generated $defs name
        self.defs: dict[str, Schema | None] = {}  # None while the target is being normalized
        self.end_checks: list[tuple[str, str]] = []
        self.merge_depth = 0
        self.negator = Negator(self.deref, self.finish, self.merge)

    def run(self) -> NormalizedSchema:
        out = self.node(self.root, "")
        if out is False:
            raise UnsupportedSchema("", "", "the schema accepts no value")
        schema = {} if out is True else dict(out)
        used = _references(schema, self.defs)
        if used:
            schema["$defs"] = {name: _as_dict(self.defs[name]) for name in used}
        schema = copy.deepcopy(schema)  # the last pass edits in place; targets are shared
        self.named_keys_apart(schema, "")
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
            parts.append(self.ref(schema["$ref"], ptr))
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

    # -- references ------------------------------------------------------------------------

    def ref(self, ref: Any, ptr: str) -> Schema:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise UnsupportedSchema(
                ptr,
                "$ref",
                f"external reference {ref!r}: only references inside the schema (#/...) "
                "are supported",
            )
        target_ptr = unquote(ref[1:])
        if target_ptr not in self.names:
            target = self.resolve(target_ptr, ptr)
            name = f"n{len(self.names)}"
            self.names[target_ptr] = name
            self.defs[name] = None
            self.defs[name] = self.node(target, target_ptr)
        name = self.names[target_ptr]
        done = self.defs[name]
        if isinstance(done, bool):
            return done
        return {"$ref": f"#/$defs/{name}"}

    def resolve(self, target_ptr: str, ptr: str) -> Any:
        node: Any = self.root
        for token in target_ptr.split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                raise UnsupportedSchema(ptr, "$ref", f"cannot resolve '#{target_ptr}'")
        return node

    def deref(self, schema: Schema) -> Schema:
        """The schema a bare generated reference stands for (one built already)."""
        seen = 0
        while isinstance(schema, dict) and set(schema) == {"$ref"}:
            target = self.defs.get(schema["$ref"].rsplit("/", 1)[-1])
            if target is None or seen > len(self.defs):
                return schema  # still being built: a recursive reference, left as it is
            schema, seen = target, seen + 1
        return schema

    # -- merging (allOf, siblings of $ref and anyOf) ---------------------------------------

    def merge(self, a: Schema, b: Schema, ptr: str) -> Schema:
        """A schema exactly as strict as both (the intersection), or UnsupportedSchema."""
        if a is True or b is False:
            return b
        if b is True or a is False:
            return a
        self.merge_depth += 1
        try:
            if self.merge_depth > _MAX_MERGE_DEPTH:
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
        if len(a_opts) * len(b_opts) > _MAX_BRANCHES:
            raise UnsupportedSchema(ptr, "anyOf", f"more than {_MAX_BRANCHES} merged branches")
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
                out[key] = _merge_types(x, y)
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
                out[key] = [v for v in x if any(_json_equal(v, w) for w in y)]
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
            elif not _json_equal(x, y):
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

    # -- after merging: what xgrammar would read differently -------------------------------

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
        if "type" not in out and any(k in out for ks in _TYPED_KEYWORDS.values() for k in ks):
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
            rest["$defs"] = {n: _as_dict(d) for n, d in self.defs.items() if d is not None}
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

    # -- the last pass: what xgrammar reads differently in the finished tree ---------------

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
    for key in _TYPED_KEYWORDS[kind]:
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
    return names.get("minLength", 0) <= len(name) <= names.get("maxLength", len(name))


def _references(schema: dict[str, Any], defs: dict[str, Schema | None]) -> list[str]:
    """The generated $defs the schema reaches (merged-in targets leave unused ones)."""
    found: list[str] = []
    todo = [schema]
    while todo:
        for name in re.findall(r'"#/\$defs/(n\d+)"', json.dumps(todo.pop())):
            if name not in found:
                found.append(name)
                todo.append(_as_dict(defs[name]))
    return sorted(found, key=lambda name: int(name[1:]))


def _as_dict(schema: Schema | None) -> dict[str, Any]:
    if schema is True or schema is None:
        return {}
    if schema is False:
        return {"not": {}}  # unreachable: references to false targets are inlined
    return schema


def _property(schema: dict[str, Any], name: str) -> Schema:
    props = schema.get("properties", {})
    if name in props:
        return props[name]
    return schema.get("additionalProperties", True)


def _item(schema: dict[str, Any], index: int) -> Schema:
    prefix = schema.get("prefixItems", [])
    return prefix[index] if index < len(prefix) else schema.get("items", True)


def _merge_types(x: Any, y: Any) -> list[str]:
    a, b = type_set(x), type_set(y)
    both = a & b
    if "integer" in a and "number" in b or "number" in a and "integer" in b:
        both.add("integer")
    return [t for t in ALL_TYPES if t in both]


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


def _json_equal(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) and (type(a) is bool) == (
        type(b) is bool
    )


def _disjoint(a: Schema, b: Schema, deref: Callable[[Schema], Schema]) -> bool:
    """Can no value satisfy both? True only when provable from the top-level keywords."""
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    ta, tb = type_set(a.get("type")), type_set(b.get("type"))
    if ta and tb and not _merge_types(sorted(ta), sorted(tb)):
        return True
    if "enum" in a and "enum" in b:
        return not any(_json_equal(x, y) for x in a["enum"] for y in b["enum"])
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
