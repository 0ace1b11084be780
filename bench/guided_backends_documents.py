"""Candidate documents for bench/guided_backends.py, from a schema alone: its `examples` and
`default`, two documents built from it (minimal and rich), and mutations of those two at every
node; `ordered` puts a document's keys in its schema's `properties` order, as both backends
require."""

from __future__ import annotations

import copy
import json
from typing import Any
from urllib.parse import unquote

from engine.guided.schema_refs import follow_pointer

COMPACT = (",", ":")  # the separators of every document fed to a backend
_NO_VALUE = object()
_FORMATS = {
    "date-time": "2024-01-02T03:04:05Z",
    "date": "2024-01-02",
    "time": "03:04:05Z",
    "uuid": "123e4567-e89b-12d3-a456-426614174000",
    "email": "a@example.com",
    "uri": "https://example.com/a",
    "uri-reference": "a/b",
    "hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
}


class DocumentSampler:
    """Builds one document from a schema: `rich` takes every property and the last branch,
    otherwise the required properties, defaults and the first branch."""

    def __init__(self, root: Any, rich: bool) -> None:
        self.root, self.rich = root, rich
        self.budget = 300  # nodes per document: a recursive schema would otherwise explode
        self.regex_cache: dict[str, str | None] = {}

    def resolve(self, schema: Any, depth: int = 0) -> Any:
        """The schema with $ref and allOf merged in shallowly (properties and required
        united), enough to build and order documents; the validator decides validity."""
        if not isinstance(schema, dict) or depth > 16:
            return schema
        out = {k: v for k, v in schema.items() if k not in ("$ref", "allOf")}
        parts = (
            [_ref_target(self.root, schema["$ref"])] if isinstance(schema.get("$ref"), str) else []
        )
        parts += schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []
        for part in parts:
            part = self.resolve(part, depth + 1)
            if not isinstance(part, dict):
                continue
            for key, value in part.items():
                if key == "properties" and isinstance(value, dict):
                    out["properties"] = {**value, **out.get("properties", {})}
                elif key == "required" and isinstance(value, list):
                    out["required"] = list(dict.fromkeys(out.get("required", []) + value))
                else:
                    out.setdefault(key, value)
        return out

    def sample(self, schema: Any, depth: int = 0) -> Any:
        schema = self.resolve(schema)
        self.budget -= 1
        if schema is False or depth > 8 or self.budget < 0:
            return _NO_VALUE
        if not isinstance(schema, dict) or schema == {}:
            return "x"
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return schema["enum"][-1 if self.rich else 0]
        if not self.rich:
            for key in ("default", "examples"):
                if key in schema:
                    value = schema[key]
                    return (
                        value[0]
                        if key == "examples" and isinstance(value, list) and value
                        else value
                    )
        for key in ("oneOf", "anyOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                branches = [b for b in schema[key] if b is not False]
                rest = {k: v for k, v in schema.items() if k != key}
                branch = self.resolve(branches[-1 if self.rich else 0])
                merged = {**rest, **branch} if isinstance(branch, dict) else rest
                return self.sample(merged, depth + 1)
        kind = _type_of(schema)
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "string":
            return self._string(schema)
        if kind in ("integer", "number"):
            low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
            low = low if isinstance(low, int | float) and not isinstance(low, bool) else 0
            value = low + (1 if "exclusiveMinimum" in schema else 0)
            return int(value) if kind == "integer" else value
        return {"boolean": True, "null": None}.get(kind, "x")

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props: dict[str, Any] = (
            schema["properties"] if isinstance(schema.get("properties"), dict) else {}
        )
        required = [r for r in schema.get("required", []) if isinstance(r, str)]
        # Rich near the top only: below, a recursive schema's every property recurses.
        names = list(props) if self.rich and depth < 3 else [p for p in props if p in required]
        names += [r for r in required if r not in names]
        out: dict[str, Any] = {}
        for name in names[:16]:
            sub = props.get(name, schema.get("additionalProperties", {}))
            value = self.sample(sub, depth + 1)
            if value is not _NO_VALUE:
                out[name] = value
        patterns = schema.get("patternProperties")
        if self.rich and isinstance(patterns, dict):
            for pattern, sub in list(patterns.items())[:2]:
                key = self.regex_example(pattern)
                value = self.sample(sub, depth + 1)
                if key is not None and value is not _NO_VALUE:
                    out.setdefault(key, value)
        return out

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        items = schema.get("prefixItems", schema.get("items", {}))
        minimum = schema.get("minItems", 0) if isinstance(schema.get("minItems"), int) else 0
        if isinstance(items, list):  # a tuple (draft-04 items: [...] or prefixItems)
            values = [self.sample(s, depth + 1) for s in items[: max(minimum, len(items))]]
        else:
            count = max(minimum, 1 if self.rich else 0)
            values = [self.sample(items, depth + 1) for _ in range(min(count, 4))]
        return [v for v in values if v is not _NO_VALUE]

    def _string(self, schema: dict[str, Any]) -> str:
        if isinstance(schema.get("pattern"), str):
            found = self.regex_example(schema["pattern"])
            if found is not None:
                return found
        text = _FORMATS.get(schema.get("format", ""), "x")
        low = schema.get("minLength", 0) if isinstance(schema.get("minLength"), int) else 0
        text = text.ljust(low, "x")
        high = schema.get("maxLength")
        return text[:high] if isinstance(high, int) else text

    def regex_example(self, pattern: str) -> str | None:
        """The simplest string that matches the pattern (searched, as JSON Schema's
        `pattern` is unanchored), or None where Python's `re` cannot read it."""
        if pattern not in self.regex_cache:
            self.regex_cache[pattern] = _regex_example(pattern)
        return self.regex_cache[pattern]


def _regex_example(pattern: str) -> str | None:
    import hypothesis
    from hypothesis import strategies as st

    settings = hypothesis.settings(database=None, max_examples=200, derandomize=True)
    try:
        text = hypothesis.find(st.from_regex(pattern), lambda s: True, settings=settings)
        json.dumps(text)
        return text if "\x00" not in text else None
    except Exception:  # noqa: BLE001 - an ECMA-only pattern, a surrogate: no example
        return None


def _type_of(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if isinstance(kind, str):
        return kind
    for keys, inferred in (
        (("properties", "required", "additionalProperties", "patternProperties"), "object"),
        (("items", "prefixItems", "minItems", "maxItems", "uniqueItems"), "array"),
        (("pattern", "format", "minLength", "maxLength"), "string"),
        (("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), "number"),
    ):
        if any(k in schema for k in keys):
            return inferred
    return "string"


def _ref_target(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        # An external target is not here to read: documents are built as for any value,
        # and the validator, which cannot resolve it either, leaves them unlabelled.
        return {}
    try:
        return follow_pointer(root, [t for t in unquote(ref[1:]).split("/") if t])
    except LookupError:
        return {}


def _mutations(doc: Any, path: str = "") -> list[tuple[str, Any]]:
    """(kind, replace-function input) pairs: every node of the document gets the mutations
    of its type, as (kind at path, new document)."""
    found: list[tuple[str, Any]] = []

    def put(kind: str, value: Any) -> None:
        found.append((f"{kind} at {path or '/'}", value))

    if isinstance(doc, dict):
        put("extra property", {**doc, "zz_extra": 1})
        for key in doc:
            put(f"drop {key!r}", {k: v for k, v in doc.items() if k != key})
        put("wrong type", [doc])
    elif isinstance(doc, list):
        if doc:
            put("duplicate item", doc + [copy.deepcopy(doc[0])])
        put("empty array", [])
        put("wrong type", {"a": doc})
    elif isinstance(doc, str):
        put("odd string", "not a valid value!")
        put("empty string", "")
        put("long string", "x" * 300)
        put("wrong type", 7)
    elif isinstance(doc, bool):
        put("wrong type", "true")
    elif isinstance(doc, int | float):
        put("big number", 10**9)
        put("negative number", -(10**9))
        put("fraction", 0.5)
        put("wrong type", "7")
    elif doc is None:
        put("wrong type", 0)
    children = (
        doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    )
    for key, child in children:
        for kind, value in _mutations(child, f"{path}/{key}"):
            mutated = copy.copy(doc)
            mutated[key] = value
            found.append((kind, mutated))
    return found


def candidates(schema: Any, max_docs: int) -> list[tuple[str, Any]]:
    """(label, document) pairs, de-duplicated by text, at most max_docs: the schema's own
    examples and default, two built documents, then mutations taken round-robin by kind."""
    docs: list[tuple[str, Any]] = []
    if isinstance(schema, dict):
        for i, example in enumerate(
            schema.get("examples", []) if isinstance(schema.get("examples"), list) else []
        ):
            docs.append((f"examples[{i}]", example))
        if "default" in schema:
            docs.append(("default", schema["default"]))
    bases = []
    for rich in (False, True):
        built = DocumentSampler(schema, rich).sample(schema)
        if built is not _NO_VALUE:
            label = "built, rich" if rich else "built, minimal"
            docs.append((label, built))
            bases.append((label, built))
    by_kind: dict[str, list[tuple[str, Any]]] = {}
    for label, base in bases:
        for kind, mutated in _mutations(base):
            by_kind.setdefault(kind.split(" at ")[0].split(" '")[0], []).append(
                (f"{label}: {kind}", mutated)
            )
    queues = list(by_kind.values())
    while any(queues) and len(docs) < 4 * max_docs:
        for queue in queues:
            if queue:
                docs.append(queue.pop(0))
    seen: set[str] = set()
    unique = []
    for label, doc in docs:
        text = json.dumps(doc, separators=COMPACT, ensure_ascii=False)
        if text not in seen:
            seen.add(text)
            unique.append((label, doc))
    return unique[:max_docs]


def ordered(doc: Any, schema: Any, sampler: DocumentSampler) -> Any:
    """The document with each object's keys in its schema's `properties` order (names the
    schema does not list last), since both backends fix that order."""
    schema = sampler.resolve(schema)
    if isinstance(doc, dict):
        props = schema.get("properties", {}) if isinstance(schema, dict) else {}
        props = props if isinstance(props, dict) else {}
        keys = [k for k in props if k in doc] + [k for k in doc if k not in props]
        return {k: ordered(doc[k], props.get(k, {}), sampler) for k in keys}
    if isinstance(doc, list):
        items = schema.get("items", {}) if isinstance(schema, dict) else {}
        return [ordered(v, items if isinstance(items, dict) else {}, sampler) for v in doc]
    return doc
