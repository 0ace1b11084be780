"""One schema through every backend (bench/guided_backends.py): each compiles it, every candidate
document is labelled by `jsonschema` and fed to each backend's matcher, and where a backend's
verdict differs from the label the document is kept as a wrong accept or a wrong reject."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from bench.guided_backends_documents import COMPACT, DocumentSampler, candidates, ordered


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
    sampler = DocumentSampler(schema, rich=False)
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
