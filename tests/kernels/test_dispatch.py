"""One dispatch point: which kernels an engine runs, by device, dtype and request."""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import EngineConfig
from gateway.models.engine_knobs import engine_config
from gateway.settings import Settings
from kernels import dispatch
from kernels.dispatch import Backend, select

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_triton_on_cuda_and_never_on_the_cpu() -> None:
    assert select("auto", CUDA, torch.bfloat16) is Backend.TRITON
    assert select("auto", CPU, torch.float32, cpu_kernels=False) is Backend.TORCH
    assert select("auto", CPU, torch.float16) is Backend.TORCH  # no C++ kernel takes float16


def test_a_backend_may_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select("triton", CPU, torch.float32) is Backend.TRITON
    assert select("torch", CUDA, torch.bfloat16) is Backend.TORCH
    with pytest.raises(ValueError, match="kernels must be one of"):
        select("cuda-graphs", CPU, torch.float32)
    # The choice is the config's alone: the environment reaches it only through the settings.
    monkeypatch.setenv("LORAGATE_KERNELS", "triton")
    assert select("auto", CPU, torch.float32, cpu_kernels=False) is Backend.TORCH


def test_the_server_takes_the_choice_from_its_flag_or_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAGATE_KERNELS", "torch")
    assert engine_config(Settings(model="m")).kernels == "torch"
    assert engine_config(Settings(model="m", kernels="native")).kernels == "native"
    monkeypatch.delenv("LORAGATE_KERNELS")
    assert engine_config(Settings(model="m")).kernels == "auto"
    with pytest.raises(ValueError):
        Settings(model="m", kernels="cuda-graphs")  # type: ignore[arg-type]


def test_triton_on_the_cpu_is_refused_without_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.triton_ops(CPU)
    assert os.environ["TRITON_INTERPRET"] == "0"  # nothing written


def test_the_engine_config_validates_the_knob() -> None:
    assert EngineConfig(model="m", kernels="triton").kernels == "triton"
    with pytest.raises(ValueError, match="kernels must be auto, triton, native or torch"):
        EngineConfig(model="m", kernels="cuda")


def test_triton_ops_load_interpreted_on_the_cpu() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    ops = dispatch.triton_ops(CPU)
    assert isinstance(ops.rms_norm.__globals__["_rms_norm_kernel"], InterpretedFunction)
