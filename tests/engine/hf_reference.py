"""The reference every engine test compares with: Hugging Face transformers' greedy
`generate`, and peft's `PeftModel` for adapters."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = True
) -> list[list[int]]:
    """Greedy output token ids of each prompt, generated one prompt at a time (no padding)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return greedy(model, prompts, max_new_tokens, ignore_eos)


def peft_greedy(
    model_dir: Path, adapter_dir: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """The same, under the PEFT adapter at `adapter_dir`."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    return greedy(model, prompts, max_new_tokens)


def greedy(
    model: Any, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = True
) -> list[list[int]]:
    config = model.generation_config
    eos = {}
    if ignore_eos:
        # Our ignore_eos samples EOS like any token; min_new_tokens would ban it instead.
        # transformers 5 refills a config's None EOS from the model's: the keyword too.
        config = copy.deepcopy(config)
        config.eos_token_id = None
        eos = {"eos_token_id": None}
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **eos,
        )
        outs.append(gen[0, len(prompt) :].tolist())
    return outs
