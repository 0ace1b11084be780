"""The step token budget's default: 2048, or 512 where the CPU has no AVX-512 (issue 43), and
never less than a whole prompt without chunked prefill; an explicit value is kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.frontend.offline import LLM
from engine.model_runner import AVX2_STEP_TOKENS, DEFAULT_STEP_TOKENS, default_step_tokens
from kernels import cpu_features

CPU = torch.device("cpu")


def test_a_cpu_held_to_avx2_takes_shorter_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    assert default_step_tokens(CPU) == AVX2_STEP_TOKENS == 512
    # Without chunked prefill a whole prompt must fit a step.
    assert default_step_tokens(CPU, must_fit=8192) == 8192
    assert default_step_tokens(CPU, must_fit=256) == 512


def test_wide_vectors_and_cuda_take_the_larger_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_features.ISA_ENV, "native")
    expected = DEFAULT_STEP_TOKENS if "avx512f" in cpu_features.flags() else AVX2_STEP_TOKENS
    assert default_step_tokens(CPU) == expected
    assert default_step_tokens(torch.device("cuda")) == DEFAULT_STEP_TOKENS == 2048


def test_the_engine_schedules_with_the_resolved_budget(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    llm = LLM(model=str(demo_model_dir), kv_cache_memory=8 << 20, dtype="float32")
    assert llm.engine.scheduler.max_num_batched_tokens == AVX2_STEP_TOKENS
    chosen = LLM(
        model=str(demo_model_dir),
        kv_cache_memory=8 << 20,
        dtype="float32",
        max_num_batched_tokens=96,
    )
    assert chosen.engine.scheduler.max_num_batched_tokens == 96
