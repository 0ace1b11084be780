"""Compiling guided-decoding specs: the canonical text a spec is cached by, the checks a JSON
schema passes first (size, depth, what xgrammar can enforce), and `GrammarCache`, which
compiles on background threads into a bounded LRU of grammars and refusals."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.errors import GuidedSpecError
from engine.guided.matcher import CompiledSpec, SequenceGrammar, _EndCheck, timeout_message
from engine.guided.schema import (
    NormalizedSchema,
    UnsupportedSchema,
    escape_pointer,
    normalize_schema,
    python_regex,
)
from engine.request import GuidedSpec

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# Compact JSON: no whitespace between tokens, so none for the model to choose.
JSON_SEPARATORS = (",", ":")

# What xgrammar 0.2.9 would accept without enforcing is rewritten or refused by
# engine/guided/schema.py (REFUSED_KEYWORDS there; tests/engine/guided/test_json_schema.py
# pins each).

# xgrammar's C++ errors start with "[12:00:00] /project/cpp/file.cc:123: " and sometimes
# "Check failed: (...) is false: "; the client needs neither.
_XGRAMMAR_ERROR_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: .*? is false: )?")


# -- checks --------------------------------------------------------------------------------


def canonical_text(spec: GuidedSpec) -> str:
    """The spec's payload as compact text: what the size limit counts and the cache key holds.

    Not key-sorted: a schema's property order is the order the output writes them in, so
    two orders are two grammars.
    """
    document = spec.json_schema if spec.json_schema is not None else spec.structural_tag
    if document is not None:
        try:
            return json.dumps(document, ensure_ascii=False, separators=JSON_SEPARATORS)
        except RecursionError:
            raise GuidedSpecError("the JSON schema nests too deeply") from None
        except (TypeError, ValueError) as exc:  # a Python caller's set, bytes, ...
            raise GuidedSpecError(f"the JSON schema is not JSON: {exc}") from None
    if spec.choice is not None:
        return json.dumps(spec.choice, ensure_ascii=False)
    return spec.regex or spec.grammar or ""


def check_schema(schema: dict[str, Any], max_depth: int) -> NormalizedSchema:
    """The schema xgrammar gets and its end checks; refuses a schema that is too deep,
    invalid, or uses what decoding cannot enforce (naming the JSON pointer and keyword)."""
    depth = _nesting_depth(schema)
    if depth > max_depth:
        raise GuidedSpecError(
            f"the JSON schema nests {depth} levels deep; the limit is {max_depth}"
        )
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)
    try:
        validator.check_schema(schema, format_checker=_meta_format_checker(validator))
    except jsonschema.SchemaError as exc:
        where = "".join(f"/{escape_pointer(str(p))}" for p in exc.path) or "the top level"
        raise GuidedSpecError(f"invalid JSON schema at {where}: {exc.message}") from None
    try:
        return normalize_schema(schema)
    except UnsupportedSchema as exc:
        raise GuidedSpecError(str(exc)) from None
    except RecursionError:
        raise GuidedSpecError("the JSON schema nests too deeply") from None


def _meta_format_checker(validator: Any) -> Any:
    """The metaschema's format checker, but `regex` reads ECMA-262 named groups (which `re`
    refuses); patterns `re` cannot read are refused by normalize_schema, naming the pointer."""
    import jsonschema

    meta = jsonschema.validators.validator_for(validator.META_SCHEMA, default=validator)
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(meta.FORMAT_CHECKER.checkers)
    checker.checkers["regex"] = (lambda p: not isinstance(p, str) or _is_regex(p), re.error)
    return checker


def _is_regex(pattern: str) -> bool:
    re.compile(python_regex(pattern))
    return True


def schema_end_checks(schema: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """(JSON pointer, keyword) pairs decoding does not enforce for this schema: the finished
    document needs validating. Empty for a schema enforced in full; raises GuidedSpecError
    for one the engine refuses."""
    return check_schema(schema, max_depth=1 << 30).end_checks


def _nesting_depth(value: Any) -> int:
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


# -- compiling -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GuidedLimits:
    """What a request may ask to compile, and how long it waits; how many compiled grammars
    are kept (EngineConfig's guided_* fields)."""

    cache_size: int = 256  # grammars and refusals kept, least recently used dropped
    max_schema_bytes: int = 64 << 10  # a schema (compact JSON), regex, grammar or choices
    max_schema_depth: int = 32  # JSON nesting levels of a schema
    compile_timeout: float = 10.0  # seconds a request waits for its grammar


class GrammarCache:
    """Compiled grammars by canonical spec: a bounded LRU filled by background compiles.

    Thread-safe: the engine thread submits as requests arrive, the gateway awaits the same
    futures to answer 400 before a stream starts. An entry is a future whose result is a
    CompiledSpec or the GuidedSpecError that refused the spec (deterministic, so kept too).
    A compile past the timeout fails its requests but keeps running (xgrammar cannot be
    interrupted) and its result is cached; another request for the same spec waits on the
    same future rather than starting a second compile.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        limits: GuidedLimits,
        *,
        max_workers: int = 2,
    ) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_entries = limits.cache_size
        self.max_bytes = limits.max_schema_bytes
        self.max_depth = limits.max_schema_depth
        self.compile_timeout = limits.compile_timeout
        self._tokenizer = tokenizer
        self._max_workers = max_workers
        self._entries: OrderedDict[str, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        self._json_filter: torch.Tensor | None = None
        self._compiler_lock = threading.Lock()
        self._end_check = _EndCheck(self.stop_token_ids, vocab_size)

    def submit(self, spec: GuidedSpec) -> Future[Any]:
        """The spec's compile future (a cache hit is already done). Raises GuidedSpecError
        at once for a spec over the size limit or one that already failed to compile."""
        text = canonical_text(spec)
        size = len(text.encode())
        if size > self.max_bytes:
            raise GuidedSpecError(
                f"the {_name(spec)} takes {size} bytes; the limit is {self.max_bytes}"
            )
        key = f"{spec.kind}:{'strict' if spec.strict else 'loose'}:{text}"
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
            else:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(
                        self._max_workers, thread_name_prefix="grammar-compile"
                    )
                future = self._executor.submit(self._compile, spec)
                self._entries[key] = future
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        if future.done() and isinstance(future.result(), GuidedSpecError):
            raise future.result()
        return future

    async def compile(self, spec: GuidedSpec) -> None:
        """Wait, without blocking the event loop, until the spec has compiled; raises
        GuidedSpecError when it cannot, or not within the compile timeout."""
        future = asyncio.wrap_future(self.submit(spec))
        done, _ = await asyncio.wait({future}, timeout=self.compile_timeout)
        if not done:
            raise GuidedSpecError(timeout_message(self.compile_timeout))
        result = future.result()
        if isinstance(result, GuidedSpecError):
            raise result

    def sequence_grammar(self, future: Future[Any]) -> SequenceGrammar:
        return SequenceGrammar(future, self.compile_timeout, self._end_check)

    def _compile(self, spec: GuidedSpec) -> CompiledSpec | GuidedSpecError:
        """Runs on a compile thread; returns the refusal instead of raising it, so that
        every waiter reads the same result and no exception is left unretrieved."""
        start = time.perf_counter()
        try:
            end_checks: tuple[tuple[str, str], ...] = ()
            if spec.json_schema is not None:
                normalized = check_schema(spec.json_schema, self.max_depth)
                end_checks = normalized.end_checks
                spec = dataclasses.replace(spec, json_schema=normalized.schema)
            elif spec.structural_tag is not None:
                tag = _normalized_tag(spec.structural_tag, self.max_depth)
                spec = dataclasses.replace(spec, structural_tag=tag)
            compiled = self._compile_unchecked(spec)
            if end_checks:
                compiled = dataclasses.replace(compiled, end_checks=end_checks)
            if self._end_check.matches_only_empty(compiled):
                raise GuidedSpecError(f"the {_name(spec)} matches only the empty string")
        except GuidedSpecError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError alike
            message = _XGRAMMAR_ERROR_PREFIX.sub("", str(exc).strip())
            return GuidedSpecError(f"cannot compile the {_name(spec)}: {message}")
        elapsed_ms = 1e3 * (time.perf_counter() - start)
        logger.debug("compiled a %s grammar in %.1f ms", spec.kind, elapsed_ms)
        return compiled

    def _compile_unchecked(self, spec: GuidedSpec) -> CompiledSpec:
        compiler = self._xgrammar_compiler()
        if spec.json_schema is not None or spec.json_object:
            # json_object: any object with values of any type, i.e. the schema {"type": "object"}.
            schema = json.dumps(spec.json_schema) if spec.json_schema else '{"type": "object"}'
            grammar = compiler.compile_json_schema(
                schema,
                any_whitespace=False,
                separators=JSON_SEPARATORS,
                strict_mode=spec.strict and not spec.json_object,
            )
            return CompiledSpec(grammar, self._json_filter)
        if spec.regex is not None:
            return CompiledSpec(compiler.compile_regex(spec.regex), None)
        if spec.structural_tag is not None:
            return CompiledSpec(compiler.compile_structural_tag(spec.structural_tag), None)
        if spec.choice is not None:
            # A JSON string literal is also an EBNF string literal (same quoting and escapes).
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return CompiledSpec(compiler.compile_grammar(f"root ::= {alternatives}"), None)
        assert spec.grammar is not None
        return CompiledSpec(compiler.compile_grammar(spec.grammar), None)

    def _xgrammar_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._json_filter = _no_control_bytes(
                    info.decoded_vocab, self.vocab_size, self.stop_token_ids
                )
                # Our LRU caches; xgrammar's own cache would be a second, unbounded copy.
                # Dynamic compilation builds a state's token masks when decoding first
                # reaches it, not every state's up front: on real-world schemas compile p95
                # falls from 1.3 s to 13 ms, and a first visit costs its step 0.1-11 ms
                # (bench/guided_schemas.py measures both).
                self._compiler = xgr.GrammarCompiler(
                    info, cache_enabled=False, enable_dynamic_compilation=True
                )
            return self._compiler


def _no_control_bytes(
    decoded_vocab: Sequence[bytes], vocab_size: int, stop_token_ids: Sequence[int]
) -> torch.Tensor:
    """A bitmask row of the tokens compact JSON can use: none holding a byte below 0x20.

    Compact JSON has no whitespace outside strings, and inside strings control characters
    must be escaped; but xgrammar 0.2.9 lets a length-bounded string (maxLength) take them
    raw, which json.loads rejects. Every JSON grammar's mask is ANDed with this row.
    """
    allowed = np.zeros((vocab_size + 31) // 32 * 32, dtype=bool)
    for token_id, text in enumerate(decoded_vocab[:vocab_size]):
        allowed[token_id] = not text or min(text) >= 0x20
    allowed[list(stop_token_ids)] = True
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32))


def _normalized_tag(node: Any, max_depth: int) -> Any:
    """The structural tag with each JSON schema in it normalized (check_schema): the tags'
    contents are enforced as fully as a response_format schema is."""
    if isinstance(node, list):
        return [_normalized_tag(item, max_depth) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
        return node | {"json_schema": check_schema(node["json_schema"], max_depth).schema}
    return {key: _normalized_tag(value, max_depth) for key, value in node.items()}


def _name(spec: GuidedSpec) -> str:
    names = {"json_schema": "JSON schema", "json_object": "JSON object"}
    return names.get(spec.kind, spec.kind.replace("_", " "))
