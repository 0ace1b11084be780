"""xgrammar (after our normalizer) against llguidance (the raw schema), on the same schemas
and the same documents: which backend accepts a schema, how fast it compiles, and whether
its matcher accepts exactly the documents the `jsonschema` validator accepts.

    python -m bench.guided_backends --schemas DIR [--tokenizer models/smollm2] [--loose]
        [--max-docs N] [--json FILE]

A measurement for issue 15, not an integration: llguidance is not a project dependency.
Install it into the venv to run this (`pip install llguidance==1.9.1`; it pulls in nothing
else); without it the bench exits with that message.

For every `*.json` schema in DIR, with one tokenizer (SmolLM2's by default):

1. Compile. xgrammar through the engine's own path: `GrammarCache` (check_schema, the
   normalizer, xgrammar's compile, the empty-grammar check), strict as `response_format`
   gives by default (`--loose`: strict off). llguidance on the raw schema,
   `grammar_from_json_schema` with compact separators and no free whitespace (what the
   engine's grammar allows), then `LLMatcher` and its first mask: llguidance builds its
   lexer lazily, so the first mask is part of the work xgrammar does ahead. A refusal is the
   backend's error (llguidance's is `LLMatcher.get_error()`); llguidance's grammar warnings
   are printed. Cold, one schema at a time; each backend's tokenizer set-up is not counted.
2. Documents. Candidates from the schema itself: its top-level `examples` and `default`,
   two documents built from it (a minimal one: required properties, defaults, first
   branches; a rich one: every property, last branches, one item per array, strings matching
   their pattern or format), then mutations of those two at every node (an extra property,
   a dropped property, a duplicated array item, an empty array, a string breaking a
   pattern/format/enum, an empty and a long string, numbers out of range, wrong types).
   Each is labelled by `jsonschema` (the schema's draft, its format checker); one the
   validator cannot resolve (an external $ref) is left out. Documents are compact JSON
   with keys in the schema's `properties` order, which both backends fix.
3. Exactness. Each document's tokens (the tokenizer's own encoding) are fed one by one to a
   fresh matcher of each backend, then a stop token: accepted means every token and the
   stop token were taken. Before each token the backend's mask is filled and timed, and
   checked to allow that token exactly when the matcher takes it. A backend that accepts a
   document the validator rejects is the dangerous disagreement; for xgrammar it is split
   into those covered by the normalizer's end checks (the gateway validates those at the
   end: oneOf that is not provably disjoint, uniqueItems) and silent ones.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from rich.console import Console
from rich.table import Table

DEFAULT_TOKENIZER = "models/smollm2"
COMPACT = (",", ":")
INSTALL_HINT = (
    "llguidance is not installed; this bench measures it against xgrammar. Install it into "
    "the venv for the measurement only: .venv/bin/python -m pip install llguidance==1.9.1"
)
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


# -- documents from a schema -----------------------------------------------------------------


class _Sampler:
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
    node = root
    for token in [t for t in unquote(ref[1:]).split("/") if t]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return {}
    return node


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
        built = _Sampler(schema, rich).sample(schema)
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


def ordered(doc: Any, schema: Any, sampler: _Sampler) -> Any:
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


# -- the two backends --------------------------------------------------------------------------


@dataclass(slots=True)
class Verdict:
    """One document through one backend's matcher."""

    accepted: bool
    mask_us: list[float]
    mask_mismatches: int  # tokens whose mask bit disagreed with the matcher's accept


def _bit(mask: Any, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


class Xgrammar:
    """The engine's own compile path: its GrammarCache, its limits, strict by default."""

    name = "xgrammar"

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos: list[int], model_dir: str, strict: bool
    ) -> None:
        from engine.config import EngineConfig
        from engine.llm_engine import grammar_cache

        self.cache = grammar_cache(EngineConfig(model=model_dir), tokenizer, vocab_size, eos)
        self.cache._xgrammar_compiler()  # tokenizer info: once, not part of a compile
        self.stop, self.vocab_size, self.strict = eos[0], vocab_size, strict

    def compile(self, schema: Any) -> tuple[Any, str, list[str]]:
        from engine.errors import GuidedSpecError
        from engine.request import GuidedSpec

        try:
            result = self.cache.submit(GuidedSpec(json_schema=schema, strict=self.strict)).result()
        except (GuidedSpecError, ValueError) as exc:
            return None, str(exc), []
        if isinstance(result, Exception):
            return None, str(result), []
        return result, "", []

    def end_check_keywords(self, compiled: Any) -> set[str]:
        return {keyword for _, keyword in compiled.end_checks}

    def run(self, compiled: Any, tokens: list[int]) -> Verdict:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled.grammar)
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        times, mismatches = [], 0
        for token in tokens + [self.stop]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(1e6 * (time.perf_counter() - t0))
            allowed = _bit(mask[0], token)
            taken = matcher.accept_token(token)
            mismatches += allowed != taken
            if not taken:
                return Verdict(False, times, mismatches)
        return Verdict(matcher.is_terminated(), times, mismatches)


class Llguidance:
    """llguidance on the raw schema: its JSON Schema support, its refusals and warnings."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.stop, self.vocab_size = eos[0], vocab_size
        self.compile({"type": "object"})  # first-use set-up, not part of any schema's compile

    def compile(self, schema: Any) -> tuple[Any, str, list[str]]:
        import llguidance.numpy as llnp

        options: Any = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=options
            )
        except ValueError as exc:
            return None, str(exc), []
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return None, matcher.get_error(), []
        llnp.fill_next_token_bitmask(matcher, llnp.allocate_token_bitmask(1, self.vocab_size))
        if matcher.is_error():
            return None, matcher.get_error(), []
        matcher.reset()
        return grammar, "", list(matcher.get_grammar_warnings())

    def run(self, grammar: Any, tokens: list[int]) -> Verdict:
        import llguidance.numpy as llnp

        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        mask = llnp.allocate_token_bitmask(1, self.vocab_size)
        times, mismatches = [], 0
        for token in tokens + [self.stop]:
            t0 = time.perf_counter()
            llnp.fill_next_token_bitmask(matcher, mask)
            times.append(1e6 * (time.perf_counter() - t0))
            allowed = _bit(mask[0], token)
            taken = matcher.consume_token(token)
            mismatches += allowed != taken
            if not taken:
                return Verdict(False, times, mismatches)
        return Verdict(not matcher.is_error(), times, mismatches)


# -- the run -----------------------------------------------------------------------------------


@dataclass(slots=True)
class BackendResult:
    accepted: bool = False
    reason: str = ""
    warnings: list[str] = field(default_factory=list)
    compile_ms: float | None = None
    wrong_accepts: list[dict[str, Any]] = field(default_factory=list)
    wrong_rejects: list[dict[str, Any]] = field(default_factory=list)
    mask_mismatches: int = 0
    mask_us: list[float] = field(default_factory=list)


@dataclass(slots=True)
class SchemaRow:
    name: str
    num_valid: int = 0
    num_invalid: int = 0
    num_unlabelled: int = 0
    backends: dict[str, BackendResult] = field(default_factory=dict)


def label(schema: Any, doc: Any) -> tuple[bool | None, list[str]]:
    """(valid?, violated keywords) by jsonschema, or (None, []) where it cannot tell."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    try:
        errors = list(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(doc))
    except Exception:  # noqa: BLE001 - an unresolvable $ref and the like
        return None, []
    return not errors, sorted({str(e.validator) for e in errors})


def bench_schema(
    name: str, schema: Any, backends: list[Any], tokenizer: Any, max_docs: int
) -> SchemaRow:
    row = SchemaRow(name)
    compiled = {}
    for backend in backends:
        t0 = time.perf_counter()
        handle, reason, warnings = backend.compile(schema)
        result = BackendResult(handle is not None, reason.strip(), warnings)
        if handle is not None:
            result.compile_ms = 1e3 * (time.perf_counter() - t0)
        row.backends[backend.name] = result
        compiled[backend.name] = handle
    sampler = _Sampler(schema, rich=False)
    for doc_label, doc in candidates(schema, max_docs):
        doc = ordered(doc, schema, sampler)
        valid, keywords = label(schema, doc)
        if valid is None:
            row.num_unlabelled += 1
            continue
        row.num_valid += valid
        row.num_invalid += not valid
        text = json.dumps(doc, separators=COMPACT, ensure_ascii=False)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        for backend in backends:
            handle, result = compiled[backend.name], row.backends[backend.name]
            if handle is None:
                continue
            verdict = backend.run(handle, tokens)
            result.mask_us += verdict.mask_us
            result.mask_mismatches += verdict.mask_mismatches
            if verdict.accepted == valid:
                continue
            entry: dict[str, Any] = {
                "document": doc_label,
                "text": text[:200],
                "keywords": keywords,
            }
            if verdict.accepted:
                checked: set[str] = (
                    backend.end_check_keywords(handle)
                    if hasattr(backend, "end_check_keywords")
                    else set()
                )
                entry["end_checked"] = bool(keywords) and set(keywords) <= checked
                result.wrong_accepts.append(entry)
            else:
                result.wrong_rejects.append(entry)
    return row


def _percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


def summary(rows: list[SchemaRow], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"schemas": len(rows)}
    for name in names:
        results = [r.backends[name] for r in rows]
        compile_ms = [b.compile_ms for b in results if b.compile_ms is not None]
        mask_us = [t for b in results for t in b.mask_us]
        wrong = [w for b in results for w in b.wrong_accepts]
        out[name] = {
            "accepted": sum(b.accepted for b in results),
            "compile_ms_p50": _percentile(compile_ms, 50),
            "compile_ms_p95": _percentile(compile_ms, 95),
            "compile_ms_max": max(compile_ms, default=None),
            "mask_us_p50": _percentile(mask_us, 50),
            "mask_us_p95": _percentile(mask_us, 95),
            "documents_checked": sum(
                r.num_valid + r.num_invalid for r in rows if r.backends[name].accepted
            ),
            "wrong_accepts": len(wrong),
            "wrong_accepts_silent": sum(not w.get("end_checked") for w in wrong),
            "wrong_rejects": sum(len(b.wrong_rejects) for b in results),
            "mask_mismatches": sum(b.mask_mismatches for b in results),
        }
    return out


# -- tables ------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def schema_table(rows: list[SchemaRow], names: list[str]) -> Table:
    table = Table(title="per schema: compile, and disagreements with jsonschema")
    table.add_column("schema")
    table.add_column("docs ok/bad", justify="right")
    for name in names:
        short = "xgr" if name == "xgrammar" else "llg"
        table.add_column(f"{short} ms", justify="right")
        table.add_column(f"{short} wrong acc", justify="right")
        table.add_column(f"{short} wrong rej", justify="right")
    for row in rows:
        cells = [row.name, f"{row.num_valid}/{row.num_invalid}"]
        for name in names:
            b = row.backends[name]
            if not b.accepted:
                cells += ["refused", "-", "-"]
                continue
            silent = sum(not w.get("end_checked") for w in b.wrong_accepts)
            ended = len(b.wrong_accepts) - silent
            acc = str(silent) + (f" (+{ended} end-checked)" if ended else "")
            cells += [_ms(b.compile_ms), acc, str(len(b.wrong_rejects))]
        table.add_row(*cells)
    return table


def totals_table(total: dict[str, Any], names: list[str]) -> Table:
    table = Table(title=f"totals over {total['schemas']} schemas")
    table.add_column("")
    for name in names:
        table.add_column(name, justify="right")
    rows = [
        ("schemas accepted", lambda t: f"{t['accepted']} of {total['schemas']}"),
        (
            "compile ms p50 / p95 / max",
            lambda t: " / ".join(
                _ms(t[k]) for k in ("compile_ms_p50", "compile_ms_p95", "compile_ms_max")
            ),
        ),
        (
            "mask µs per token p50 / p95",
            lambda t: f"{_ms(t['mask_us_p50'])} / {_ms(t['mask_us_p95'])}",
        ),
        ("documents checked", lambda t: str(t["documents_checked"])),
        ("wrongly ACCEPTED (silent)", lambda t: str(t["wrong_accepts_silent"])),
        (
            "wrongly accepted, end-checked",
            lambda t: str(t["wrong_accepts"] - t["wrong_accepts_silent"]),
        ),
        ("wrongly rejected", lambda t: str(t["wrong_rejects"])),
        ("mask vs matcher mismatches", lambda t: str(t["mask_mismatches"])),
    ]
    for title, cell in rows:
        table.add_row(title, *[cell(total[name]) for name in names])
    return table


def print_report(rows: list[SchemaRow], names: list[str], console: Console) -> dict[str, Any]:
    console.print(schema_table(rows, names))
    refusals = Table(title="refusals and warnings")
    for column in ("schema", "backend", "refused because / warns"):
        refusals.add_column(column)
    for row in rows:
        for name in names:
            b = row.backends[name]
            if not b.accepted:
                refusals.add_row(row.name, name, b.reason[:240])
            for warning in b.warnings:
                refusals.add_row(row.name, name, f"warning: {warning[:230]}")
    if refusals.row_count:
        console.print(refusals)
    wrong = Table(title="disagreements: document, keywords the validator reports")
    for column in ("schema", "backend", "verdict", "document", "keywords"):
        wrong.add_column(column)
    for row in rows:
        for name in names:
            b = row.backends[name]
            for w in b.wrong_accepts:
                verdict = "accepted, end-checked" if w.get("end_checked") else "ACCEPTED"
                wrong.add_row(row.name, name, verdict, w["document"], ", ".join(w["keywords"]))
            for w in b.wrong_rejects:
                wrong.add_row(row.name, name, "rejected", w["document"], "(valid)")
    if wrong.row_count:
        console.print(wrong)
    total = summary(rows, names)
    console.print(totals_table(total, names))
    return total


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.guided_backends", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--schemas", type=Path, required=True, metavar="DIR", help="*.json schemas")
    p.add_argument(
        "--tokenizer", default=DEFAULT_TOKENIZER, help="model directory (tokenizer, config)"
    )
    p.add_argument("--loose", action="store_true", help="xgrammar with strict mode off")
    p.add_argument("--max-docs", type=int, default=40, help="candidate documents per schema")
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = p.parse_args(argv)
    try:
        import llguidance  # noqa: F401
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    paths = sorted(args.schemas.glob("*.json"))
    if not paths:
        raise SystemExit(f"no *.json schemas in {args.schemas}")
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from engine.models.llama import eos_token_ids

    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    hf_config = AutoConfig.from_pretrained(args.tokenizer)
    eos = sorted(eos_token_ids(hf_config, tokenizer, args.tokenizer))
    vocab_size = int(hf_config.vocab_size)
    backends: list[Any] = [
        Xgrammar(tokenizer, vocab_size, eos, args.tokenizer, strict=not args.loose),
        Llguidance(tokenizer, vocab_size, eos),
    ]
    names = [b.name for b in backends]
    console = Console() if Console().is_terminal else Console(width=160)
    rows = []
    for path in paths:
        schema = json.loads(path.read_text(encoding="utf-8"))
        t0 = time.perf_counter()
        rows.append(bench_schema(path.stem, schema, backends, tokenizer, args.max_docs))
        console.log(f"{path.stem}: {time.perf_counter() - t0:.1f} s")
    console.print(
        f"{len(paths)} schemas in {args.schemas}, tokenizer {args.tokenizer}, xgrammar "
        f"{'loose' if args.loose else 'strict'} after the normalizer, llguidance "
        f"{llguidance.__version__} on the raw schema"
    )
    total = print_report(rows, names, console)
    if args.json is not None:
        out: dict[str, Any] = {"summary": total, "rows": [asdict(r) for r in rows]}
        for r in out["rows"]:
            for b in r["backends"].values():
                b["mask_us"] = len(b["mask_us"])  # the count; the percentiles are in the summary
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        console.print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
