"""The shipped real-world schemas (tests/data/schemas/, from SchemaStore): each one is either
compiled by the engine's GrammarCache or refused with a GuidedSpecError that says what it
refuses; never another exception, never a compile past the engine's timeout.

No acceptance percentage is pinned here: what the engine accepts is meant to grow.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from engine.config import EngineConfig
from engine.errors import GuidedSpecError
from engine.guided import CompiledSpec, GrammarCache
from engine.request import GuidedSpec

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "data" / "schemas"
SCHEMA_FILES = sorted(SCHEMA_DIR.glob("*.json"))
# A compile may finish a little after the engine's timeout fires; past this it hung.
TIMEOUT_MARGIN_S = 5.0


def test_corpus_is_shipped_with_its_source() -> None:
    assert len(SCHEMA_FILES) >= 5
    source = (SCHEMA_DIR / "SOURCE.md").read_text(encoding="utf-8")
    for path in SCHEMA_FILES:
        assert path.name in source, f"{path.name} is not listed in SOURCE.md"
        assert path.stat().st_size < 64 << 10


@pytest.fixture(scope="module")
def cache(demo_model_dir: Path) -> GrammarCache:
    """The engine's own GrammarCache (its factory, its default limits and timeout)."""
    from engine.llm_engine import grammar_cache
    from engine.models.llama import eos_token_ids

    hf_config = AutoConfig.from_pretrained(demo_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    eos = eos_token_ids(hf_config, tokenizer, str(demo_model_dir))
    config = EngineConfig(model=str(demo_model_dir), dtype="float32")
    return grammar_cache(config, tokenizer, int(hf_config.vocab_size), eos)


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=[p.stem for p in SCHEMA_FILES])
def test_schema_compiles_or_is_refused_by_name(cache: GrammarCache, path: Path) -> None:
    schema = json.loads(path.read_text(encoding="utf-8"))
    try:
        spec = GuidedSpec(json_schema=schema)
        result = cache.submit(spec).result(timeout=cache.compile_timeout + TIMEOUT_MARGIN_S)
    except GuidedSpecError as exc:  # refused before the compile (size)
        result = exc
    except FutureTimeout:
        pytest.fail(f"{path.name}: no compile result within {cache.compile_timeout:g} s")
    if isinstance(result, GuidedSpecError):
        message = str(result).strip()
        assert message, f"{path.name}: a refusal without a message"
        assert "Traceback" not in message and not message.startswith("[")
        return
    assert isinstance(result, CompiledSpec), f"{path.name}: {type(result).__name__}"
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(result.grammar)
    assert not matcher.is_terminated()  # something can be written under it


def _patterns(node: object, found: set[str]) -> set[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                found.add(value)
            if key == "patternProperties" and isinstance(value, dict):
                found.update(value)
            _patterns(value, found)
    elif isinstance(node, list):
        for value in node:
            _patterns(value, found)
    return found


CORPUS_PATTERNS = sorted(
    set().union(
        *(_patterns(json.loads(p.read_text(encoding="utf-8")), set()) for p in SCHEMA_FILES)
    )
)
# Strings both sides read alike: printable ASCII without JSON's escapes (xgrammar's string
# patterns match the raw characters, so escaped ones are the grammar's to refuse).
_PLAIN = re.compile(r"[ !#-\[\]-~]*")
_EDITS = "a0-._/:xZ "


@pytest.mark.parametrize("pattern", CORPUS_PATTERNS)
def test_corpus_patterns_mean_on_xgrammar_what_they_mean_in_json_schema(pattern: str) -> None:
    """Every pattern of the corpus, after the normalizer, matches on xgrammar exactly the
    strings JSON Schema's search matches: examples drawn from the pattern (hypothesis) and
    edits of them. Catches xgrammar misreading a construct, as it did `(-[0-9]+)?`."""
    import xgrammar as xgr
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from engine.guided.schema import UnsupportedSchema, normalize_schema, python_regex

    try:
        normalized = normalize_schema({"type": "string", "pattern": pattern}).schema
    except UnsupportedSchema:
        pytest.skip("refused by name (tests/engine/guided/test_json_schema.py)")
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)
    grammar = compiler.compile_json_schema(json.dumps(normalized), any_whitespace=False)
    searched = re.compile(python_regex(pattern))
    samples: list[str] = []

    @settings(
        max_examples=30, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(st.from_regex(searched).filter(_PLAIN.fullmatch))
    def collect(text: str) -> None:
        samples.append(text)

    collect()
    rng = random.Random(pattern)
    samples += [_edit(s, rng) for s in samples] + ["", "a", "x y", "a/b.c"]
    wrong = []
    for text in samples:
        matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
        accepted = matcher.accept_string(json.dumps(text)) and matcher.is_terminated()
        if accepted != bool(searched.search(text)):
            wrong.append((text, accepted))
    assert not wrong, f"(string, xgrammar accepts) where JSON Schema disagrees: {wrong[:5]}"


def _edit(text: str, rng: random.Random) -> str:
    chars = list(text)
    for _ in range(rng.randint(1, 3)):
        i = rng.randint(0, len(chars))
        choice = rng.random()
        if choice < 0.4 and chars:
            del chars[min(i, len(chars) - 1)]
        elif choice < 0.8:
            chars.insert(i, rng.choice(_EDITS))
        elif chars:
            chars[min(i, len(chars) - 1)] = rng.choice(_EDITS)
    return "".join(chars)
