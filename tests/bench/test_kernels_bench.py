"""`loragate-bench kernels --toy` runs end to end (on the CPU: the triton interpreter)."""

from __future__ import annotations

import pytest

from bench import kernels


def test_the_toy_run_prints_both_tables_and_the_targets(capsys: pytest.CaptureFixture[str]) -> None:
    kernels.main(["--toy"])
    out = capsys.readouterr().out
    assert "paged decode attention" in out and "decode step at context 24" in out
    assert "4 x LoRA r4" in out and "4 adapters +" in out
    assert "toy run" in out
