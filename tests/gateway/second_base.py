"""A second base model for the adapter catalog: `wide`, the demo model's architecture at other
widths (only its config.json: adapters are checked against shapes, and peft builds an adapter
for it on the meta device without weights), adapters for it, and a server that knows it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import Server, build_test_app, live_server

from adapters.demo import build_demo_adapter
from adapters.peft import CONFIG_FILE, BaseModelInfo, describe_base
from engine.frontend.async_engine import AsyncEngine
from engine.models.demo import DEMO_CONFIG

WIDE = "wide"
# The demo model's depth (so a demo adapter's layers all exist) at 1.5x its widths: every
# projection's shape differs.
WIDE_CONFIG = DEMO_CONFIG | {"hidden_size": 384, "num_attention_heads": 6, "intermediate_size": 768}


def build_wide_model(root: Path) -> Path:
    """The `wide` checkpoint's config, in a directory named `wide` (the name its adapters
    record as their base model)."""
    model_dir = root / WIDE
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(WIDE_CONFIG, indent=2, sort_keys=True))
    return model_dir


def retarget(adapter: Path, out: Path, base_model: str | None) -> Path:
    """A copy of `adapter` whose config says it was trained for `base_model` (None: says
    nothing), so that only its shapes can tell it does not fit."""
    shutil.copytree(adapter, out)
    config = json.loads((out / CONFIG_FILE).read_text()) | {"base_model_name_or_path": base_model}
    (out / CONFIG_FILE).write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wide_model(tmp_path_factory.mktemp("wide-model"))


@pytest.fixture(scope="session")
def wide_base(wide_model_dir: Path) -> BaseModelInfo:
    return describe_base(wide_model_dir, extra_names=[WIDE])


@pytest.fixture(scope="session")
def wide_adapter(wide_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-8 attention adapter of `wide`, built by peft."""
    out = tmp_path_factory.mktemp("wide-adapters") / "r8-attn"
    return build_demo_adapter(wide_model_dir, out, rank=8, targets="attention", seed=21)


@pytest.fixture
def two_base_server(
    tenancy_engine: AsyncEngine,
    demo_model_dir: Path,
    wide_base: BaseModelInfo,
    database_url: str,
    tmp_path: Path,
) -> Iterator[Server]:
    """A server whose tenancy knows two base models, `demo` (served by the demo engine) and
    `wide` (adapters can be registered on it; no engine serves it here), with vLLM's runtime
    adapter routes, on a fresh database of each kind."""
    app = build_test_app(
        tenancy_engine,
        "demo",
        tmp_path,
        demo_model_dir,
        database_url,
        settings={"max_adapter_bytes": 4 << 20, "allow_local_adapter_paths": True},
        extra_bases={WIDE: wide_base},
        allow_runtime_lora_updating=True,
    )
    with live_server(app, tenancy_engine) as server:
        yield server
