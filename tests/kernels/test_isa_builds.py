"""LORAGATE_CPU_ISA=avx2: an AVX-512 machine runs as an AVX2-only one (issue 43); =avx512: an
AMX machine runs without its tiles. CI covers the kernels' older paths on whichever processor
it draws."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_features, native

ROOT = Path(__file__).resolve().parents[2]
# The kernel tests that hold each C++ op equal to its torch specification.
KERNEL_TESTS = [
    "test_build.py",
    "test_decode_attention.py",
    "test_prefill_attention.py",
    "test_rms_norm.py",
    "test_layer_ops.py",
    "test_lora_sgmv.py",
    "test_quant.py",
    "test_linear.py",
]


def test_avx2_drops_the_newer_flags_and_compiles_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(cpu_features.ISA_ENV, "AVX2")
    assert cpu_features.isa() == "avx2"
    assert not any(f.startswith(("avx512", "amx", "avx_vnni")) for f in cpu_features.flags())
    assert "avx512" not in cpu_features.flags_line()
    assert not cpu_features.native_bf16()
    assert "-mno-avx512f" in cpu_features.compile_flags()
    assert "held to AVX2" in cpu_features.describe()
    monkeypatch.setenv(cpu_features.ISA_ENV, "native")
    assert cpu_features.compile_flags() == ["-march=native"]


def test_use_isa_leaves_what_engine_processes_inherit(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--cpu-isa avx2` before the first torch operation: the variables torch, oneDNN and MKL
    read, in the environment every engine process starts with; one the user set is kept."""
    held = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    for name in (cpu_features.ISA_ENV, *held):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
    cpu_features.use_isa("avx2")
    assert os.environ[cpu_features.ISA_ENV] == "avx2"
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"


def test_an_unknown_isa_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx10")
    with pytest.raises(ValueError, match="LORAGATE_CPU_ISA='avx10'"):
        cpu_features.isa()


@pytest.mark.skipif(cpu_features.isa() != "avx2", reason="runs under LORAGATE_CPU_ISA=avx2")
def test_torch_onednn_and_our_build_are_held_to_avx2() -> None:
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    if not native.load():
        pytest.skip("the CPU kernels do not build here")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read the build with")
    (library,) = native._build_dir().glob("*.so")
    code = subprocess.run([objdump, "-d", str(library)], capture_output=True, text=True).stdout
    assert "%zmm" not in code, "an AVX-512 instruction in the AVX2 build"


def test_avx512_drops_only_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx512")
    native_flags = cpu_features._flag_set("native")
    assert cpu_features.flags() == {f for f in native_flags if not f.startswith("amx")}
    assert "-mno-amx-tile" in cpu_features.compile_flags()
    assert "-mno-avx512f" not in cpu_features.compile_flags()
    assert "AMX held off" in cpu_features.describe()


def _disassembly() -> str:
    if not native.load():
        pytest.skip("the CPU kernels do not build here")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read the build with")
    (library,) = native._build_dir().glob("*.so")
    return subprocess.run([objdump, "-d", str(library)], capture_output=True, text=True).stdout


def test_tiles_are_in_the_build_exactly_where_the_process_has_amx() -> None:
    """Prefill attention's AMX path (kernels/csrc/prefill_attention_amx.h) is compiled in
    where the process runs with amx_bf16, and left out under LORAGATE_CPU_ISA=avx512."""
    if "avx512_bf16" not in cpu_features.flags():
        pytest.skip("the tile path builds beside the AVX-512 BF16 one only")
    has_tiles = "tdpbf16ps" in _disassembly()
    assert has_tiles == ("amx_bf16" in cpu_features.flags())


@pytest.mark.parametrize(("isa", "above"), [("avx2", "avx512"), ("avx512", "amx")])
def test_the_older_builds_pass_the_kernel_tests(isa: str, above: str) -> None:
    """The kernel tests again, in a process held to `isa`, where this processor has more (an
    `above` flag); where it has not, they are the build the suite already ran."""
    if cpu_features.isa() != "native":
        pytest.skip("held already: the variables it holds torch by would pass on")
    if not any(f.startswith(above) for f in cpu_features.flags()):
        pytest.skip(f"this processor has no {above}: the suite's own kernel tests are these")
    if not native.load():
        pytest.skip("the CPU kernels do not build here")
    env = os.environ | {cpu_features.ISA_ENV: isa, "LORAGATE_CPU_KERNELS_REQUIRED": "1"}
    tests = [str(ROOT / "tests" / "kernels" / name) for name in [*KERNEL_TESTS, __file__]]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
