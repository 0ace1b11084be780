"""The weights cache (engine/checkpoints/weights_cache.py): the first load writes the weights as the
engine runs them and maps them back, later loads map the file; either way the engine answers as
Hugging Face does. A checkpoint that changed, a file that does not parse, a directory that cannot be
written: each is a load from the checkpoint, never a failed start. A file whose checkpoint is gone
is removed by the next write; a quantized engine writes none."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from engine import LLMEngine
from engine.checkpoints.weights_cache import weights_cache_at
from engine.config import EngineConfig
from engine.frontend.offline import LLM
from engine.request import SamplingParams
from tests.engine.hf_reference import hf_greedy

PROMPTS = [[5, 77, 301, 1200, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13]]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture
def checkpoint(demo_model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the demo checkpoint this test may change."""
    return Path(shutil.copytree(demo_model_dir, tmp_path / "demo"))


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> list[list[int]]:
    return hf_greedy(demo_model_dir, PROMPTS, MAX_TOKENS)


def _generate(model: Path, cache: Path | str, **config: object) -> list[list[int]]:
    llm = LLM(
        str(model),
        weights_cache_dir=str(cache),
        dtype="float32",
        kv_cache_memory=16 << 20,
        max_model_len=128,
        num_threads=1,
        **config,
    )
    outputs = llm.generate(PROMPTS, GREEDY)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _mapped_files() -> set[str]:
    """Files this process maps (/proc/self/maps)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in lines if len(line.split(maxsplit=5)) == 6}


def _cache_file(root: Path) -> Path:
    (file,) = root.glob("*.weights")
    return file


def test_the_first_load_writes_the_file_and_every_load_maps_it(
    checkpoint: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    root = tmp_path / "cache"
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint),
            weights_cache_dir=str(root),
            dtype="float32",
            kv_cache_memory=16 << 20,
            max_model_len=128,
        )
    )
    file = _cache_file(root)
    assert str(file) in _mapped_files()  # the first engine runs from the file it wrote
    written = file.stat().st_mtime_ns
    del engine
    assert _generate(checkpoint, root) == reference
    assert _cache_file(root).stat().st_mtime_ns == written  # mapped, not written again
    assert _generate(checkpoint, "none") == reference


def test_a_changed_checkpoint_is_loaded_again_and_the_file_replaced(
    checkpoint: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    root = tmp_path / "cache"
    assert _generate(checkpoint, root) == reference
    before = _cache_file(root).read_bytes()[:4096]
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same tensors, a newer file
    assert _generate(checkpoint, root) == reference
    assert _cache_file(root).read_bytes()[:4096] != before  # a new fingerprint


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # cut short
        lambda data: b"\x00" * 8 + data[8:],  # no header
        lambda data: data[:8] + b"{" + data[9:],  # a header that does not parse
    ],
    ids=["truncated", "no-header", "bad-json"],
)
def test_a_damaged_file_is_a_load_from_the_checkpoint_that_rewrites_it(
    checkpoint: Path, tmp_path: Path, reference: list[list[int]], damage: object
) -> None:
    root = tmp_path / "cache"
    _generate(checkpoint, root)
    file = _cache_file(root)
    good = file.read_bytes()
    file.write_bytes(damage(good))  # type: ignore[operator]
    assert _generate(checkpoint, root) == reference
    assert _cache_file(root).stat().st_size == len(good)


def test_a_directory_that_cannot_be_written_still_serves(
    checkpoint: Path, tmp_path: Path, reference: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "not-a-directory"
    root.write_text("a file where the cache directory would be")
    # Directly on the module's logger, enabled at WARNING: an earlier test's logging set-up
    # (a console, a dictConfig) may have stopped it propagating, raised its level or
    # disabled it.
    logger = logging.getLogger("engine.checkpoints.weights_cache")
    saved = logger.disabled, logger.level
    logger.disabled = False
    logger.setLevel(logging.WARNING)
    logger.addHandler(caplog.handler)
    try:
        assert _generate(checkpoint, root) == reference
    finally:
        logger.removeHandler(caplog.handler)
        logger.disabled, logger.level = saved
    assert "weights cache: cannot write" in caplog.text


def test_a_file_whose_checkpoint_is_gone_is_removed_by_the_next_write(
    checkpoint: Path, demo_model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "cache"
    _generate(checkpoint, root)
    orphan = _cache_file(root)
    shutil.rmtree(checkpoint)
    _generate(demo_model_dir, root)
    assert not orphan.exists()
    assert len(list(root.glob("*.weights"))) == 1


def test_quantized_or_disabled_engines_write_nothing(checkpoint: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    _generate(checkpoint, root, quantization="int8")
    _generate(checkpoint, "none")
    assert not root.exists() or not list(root.glob("*.weights"))


def test_the_setting() -> None:
    assert weights_cache_at("none") is None
    assert weights_cache_at("off") is None
    auto = weights_cache_at("auto")
    assert auto is not None and auto.root == Path.home() / ".cache" / "loragate" / "weights"
    custom = weights_cache_at("~/elsewhere")
    assert custom is not None and custom.root == Path.home() / "elsewhere"
