"""Demo adapters for the adapter tests, each built once per session on first use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from adapters.demo import build_demo_adapter

DemoAdapter = Callable[..., Path]


@pytest.fixture(scope="session")
def demo_adapter(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> DemoAdapter:
    """`demo_adapter(rank, targets="all", seed=1, rslora=False)`: a demo-model adapter's path.

    Shared by every test of the session, so tests copy it before changing anything.
    """
    root = tmp_path_factory.mktemp("demo-adapters")
    built: dict[tuple[int, str, int, bool], Path] = {}

    def get(rank: int, targets: str = "all", *, seed: int = 1, rslora: bool = False) -> Path:
        key = (rank, targets, seed, rslora)
        if key not in built:
            name = f"r{rank}-{targets}-seed{seed}" + ("-rslora" if rslora else "")
            built[key] = build_demo_adapter(
                demo_model_dir, root / name, rank=rank, targets=targets, seed=seed, rslora=rslora
            )
        return built[key]

    return get
