"""The shipped real-world schemas (tests/data/schemas/, from SchemaStore): each one is either
compiled by the engine's GrammarCache or refused with a GuidedSpecError that says what it
refuses; never another exception, never a compile past the engine's timeout.

No acceptance percentage is pinned here: what the engine accepts is meant to grow.
"""

from __future__ import annotations

import json
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from engine.config import EngineConfig
from engine.guided import CompiledSpec, GrammarCache, GuidedSpecError
from engine.request import GuidedSpec

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "data" / "schemas"
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
    from engine.llm_engine import _eos_token_ids, grammar_cache

    hf_config = AutoConfig.from_pretrained(demo_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    eos = _eos_token_ids(hf_config, tokenizer, str(demo_model_dir))
    config = EngineConfig(model=str(demo_model_dir))
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
