"""Checkpoints mapped ahead: a warm spare maps the safetensors of each model it may become, page
tables filled (MAP_POPULATE), and the engine it becomes reads its weights from there.

A checkpoint in the page cache still costs its first read through a fresh mapping a page fault
per few pages: for SmolLM2's 513 MiB, 0.04-0.05 s, as long as `cat` takes to read the file.
Mapped ahead, the load copies from memory already mapped. A mapping of the page cache holds no
memory of its own (the pages are the cache's, shared), only its page tables; the engine drops
the views once it has copied them, and the mapping with them. Tensors come out as views,
checked as strictly as the reference reader (engine.checkpoints.safetensors_view).
"""

from __future__ import annotations

import json
import mmap
import warnings
from pathlib import Path

import torch

from engine.checkpoints.safetensors_view import load_views

# One process, one engine: the spare maps, then the engine it becomes takes.
_mapped: dict[str, list[dict[str, torch.Tensor]]] = {}


def _key(model_dir: str | Path) -> str:
    return str(Path(model_dir).resolve())


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir} (pickled .bin is refused)"
        )
    return files


def premap(model_dir: str | Path) -> None:
    """Map the model's safetensors, their page tables filled."""
    views = []
    for file in safetensors_files(Path(model_dir)):
        with file.open("rb") as f:
            size = f.seek(0, 2)
            mapping = mmap.mmap(
                f.fileno(), size, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE, prot=mmap.PROT_READ
            )
        with warnings.catch_warnings():  # read-only memory: nothing writes to these views
            warnings.simplefilter("ignore", UserWarning)
            buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        views.append(load_views(buffer))
    _mapped[_key(model_dir)] = views


def take(model_dir: str | Path) -> list[dict[str, torch.Tensor]] | None:
    """The model's tensors (one dict per file) if they were mapped ahead; now the caller's."""
    return _mapped.pop(_key(model_dir), None)
