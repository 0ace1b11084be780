"""What the zygote (engine/frontend/zygote.py) does before it forks its first engine: importing
this module is that work, as multiprocessing's forkserver preloads the modules it is given.

It imports torch, transformers and the engine, loads the C++ kernels (they depend on the
machine, not the model), loads the tokenizers of the models this zygote may start and maps
their checkpoints. It starts no thread and touches no model's weights, so a fork of it is
safe and holds nothing of a model's. A forked engine finds the tokenizers here
(`preloaded_tokenizer`) and the mapped checkpoints in engine.checkpoints.checkpoint_map, both
copies of the zygote's memory, shared until written.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

# transformers resolves a model's config and tokenizer classes on first use, by name: the
# Llama family's (engine.models.llama's architectures) ahead.
import transformers.models.llama.configuration_llama  # noqa: F401
import transformers.tokenization_utils_fast  # noqa: F401
from transformers import AutoTokenizer

import engine.frontend.engine_main  # noqa: F401 - the engine: torch, transformers, the model
from engine.checkpoints import checkpoint_map
from engine.frontend.zygote import MODELS_ENV
from kernels import native

_tokenizers: dict[str, Any] = {}


def preloaded_tokenizer(path: str) -> Any:
    """The tokenizer loaded here for `path`, or None."""
    return _tokenizers.get(path)


def _warm() -> None:
    # A CUDA build is left alone: asking it whether a GPU is there initializes CUDA, which a
    # fork must not inherit. Its engines load what they need after the fork.
    if torch.version.cuda is None:
        native.load()
    for path in filter(None, os.environ.get(MODELS_ENV, "").split(os.pathsep)):
        # A tokenizer takes a fifth of a second to load (transformers parses its JSON in
        # Python), as long as the rest of a forked start; a checkpoint's first read a fault
        # per few pages. A bad path is the engine's to report, when asked to start.
        with contextlib.suppress(Exception):
            _tokenizers[path] = AutoTokenizer.from_pretrained(path)
        with contextlib.suppress(Exception):
            checkpoint_map.premap(path)


_warm()
