"""One dispatch point: which kernels an engine runs, by device, dtype and request."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from kernels import dispatch
from kernels.dispatch import Backend, select

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_triton_on_cuda_and_never_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.ENV, raising=False)
    assert select("auto", CUDA, torch.bfloat16) is Backend.TRITON
    assert select("auto", CPU, torch.float32, cpu_kernels=False) is Backend.TORCH
    assert select("auto", CPU, torch.float16) is Backend.TORCH  # no C++ kernel takes float16


def test_a_backend_may_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.ENV, raising=False)
    assert select("triton", CPU, torch.float32) is Backend.TRITON
    assert select("torch", CUDA, torch.bfloat16) is Backend.TORCH
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert select("auto", CPU, torch.float32) is Backend.TRITON
    assert select("torch", CPU, torch.float32) is Backend.TORCH  # the config wins over the env
    monkeypatch.setenv(dispatch.ENV, "cuda-graphs")
    with pytest.raises(ValueError, match="kernels must be one of"):
        select("auto", CPU, torch.float32)


def test_the_engine_config_validates_the_knob() -> None:
    assert EngineConfig(model="m", kernels="triton").kernels == "triton"
    with pytest.raises(ValueError, match="kernels must be auto, triton, native or torch"):
        EngineConfig(model="m", kernels="cuda")


def test_triton_ops_load_interpreted_on_the_cpu() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    ops = dispatch.triton_ops(CPU)
    assert isinstance(ops.rms_norm.__globals__["_rms_norm_kernel"], InterpretedFunction)
