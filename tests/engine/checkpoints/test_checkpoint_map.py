"""Checkpoints mapped ahead (engine/checkpoints/checkpoint_map.py): the engine's loader reads the
same tensors from the mapping as from the file, once; a model not mapped is read as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoints import checkpoint_map
from engine.models.llama import iter_safetensors


def test_a_mapped_checkpoint_gives_the_files_tensors_once(demo_model_dir: Path) -> None:
    reference = load_file(str(demo_model_dir / "model.safetensors"))
    checkpoint_map.premap(str(demo_model_dir))
    mapped = dict(iter_safetensors(demo_model_dir))  # the key resolves the same directory
    assert mapped.keys() == reference.keys()
    for name, tensor in reference.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name
    assert checkpoint_map.take(demo_model_dir) is None  # taken by the load
    again = dict(iter_safetensors(demo_model_dir))  # read from the file this time
    assert all(torch.equal(again[name], reference[name]) for name in reference)


def test_a_missing_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        checkpoint_map.premap(tmp_path)
