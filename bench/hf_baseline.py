"""The baseline: Hugging Face `generate` in static, left-padded batches, timed and KV-accounted."""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich.progress import Progress

from bench.workloads import Workload, best_of


def build_hf(
    model_dir: str,
    device: torch.device,
    progress: Progress,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = progress.add_task("load HF", total=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.to(device)
    model.eval()
    progress.update(task, completed=1)
    return model, tokenizer


def never_stop(config: Any) -> Any:
    """HF's equivalent of ignore_eos: no EOS at all, so EOS is sampled like any token.

    (`min_new_tokens` would ban EOS instead, and pick a different token where EOS
    is the argmax.) transformers 5 refills a config's None EOS from the model's own config:
    `generate` needs `eos_token_id=None` as a keyword too (hf_generate passes it).
    """
    config = copy.deepcopy(config)
    config.eos_token_id = None
    return config


def hf_generate(
    model: Any, tokenizer: Any, batch: list[list[int]], output_len: int, **kwargs: Any
) -> Any:
    enc = tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt")
    enc = {k: v.to(model.device) for k, v in enc.items()}
    with torch.inference_mode():
        out = model.generate(
            **enc,
            generation_config=never_stop(model.generation_config),
            max_new_tokens=output_len,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=None,
            **kwargs,
        )
    return out[:, enc["input_ids"].shape[1] :]


def hf_kv_slots(prompt_lens: Sequence[int], output_len: int) -> tuple[int, int]:
    """(allocated, used) KV token slots of one static left-padded batch, summed over passes.

    HF's cache grows by one column per forward pass, the same for every row: after pass j
    (j = 0 is the prefill) it holds max(prompt_lens) + j columns for each of the B rows, of
    which prompt_len + j are real tokens and the rest left padding. Ours is sampled after
    each step, once finished requests are freed; to match, the batch's last pass (after
    which it is discarded) is not counted: j runs over 0 .. output_len - 2.
    """
    batch, longest, total = len(prompt_lens), max(prompt_lens), sum(prompt_lens)
    alloc = used = 0
    for j in range(output_len - 1):
        alloc += batch * (longest + j)
        used += total + batch * j
    return alloc, used


def run_hf(
    model: Any,
    tokenizer: Any,
    workload: Workload,
    batch_size: int,
    output_len: int,
    progress: Progress,
    repeat: int = 1,
    *,
    label: str | None = None,
    batch_kwargs: Callable[[slice], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Time static batches through `generate`; with repeat > 1 keep the fastest run.

    `batch_kwargs(rows)` adds `generate` arguments for the batch of prompts[rows]
    (peft's per-row `adapter_names`)."""
    return best_of(
        lambda lbl: _run_hf_once(
            model, tokenizer, workload, batch_size, output_len, progress, lbl, batch_kwargs
        ),
        label or f"{workload.name} HF",
        repeat,
    )


def _run_hf_once(
    model: Any,
    tokenizer: Any,
    workload: Workload,
    batch_size: int,
    output_len: int,
    progress: Progress,
    label: str,
    batch_kwargs: Callable[[slice], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    prompts = workload.prompts
    rows = [slice(i, i + batch_size) for i in range(0, len(prompts), batch_size)]
    batches = [prompts[r] for r in rows]
    task = progress.add_task(label, total=len(prompts))
    alloc = used = 0
    for batch in batches:
        a, u = hf_kv_slots([len(p) for p in batch], output_len)
        alloc, used = alloc + a, used + u

    token_ids: list[list[int]] = []
    gc.collect()
    t0 = time.perf_counter()
    for batch, batch_rows in zip(batches, rows, strict=True):
        kwargs = batch_kwargs(batch_rows) if batch_kwargs is not None else {}
        new = hf_generate(model, tokenizer, batch, output_len, **kwargs)
        token_ids.extend(new.tolist())  # a device-to-host copy: also synchronizes CUDA
        progress.advance(task, len(batch))
    wall = time.perf_counter() - t0

    num_out = sum(len(t) for t in token_ids)
    return {
        "wall_s": wall,
        "output_tokens": num_out,
        "tok_s": num_out / wall,
        "kv_alloc_tokens": alloc,
        "kv_used_tokens": used,
        "kv_alloc_used": alloc / used if used else None,
        "ms_per_pass": 1e3 * wall / (len(batches) * output_len),
        "token_ids": token_ids,
    }
