"""`loragate-bench lora-kernel` runs end to end at a toy shape and prints its table."""

from __future__ import annotations

import pytest

from bench import lora_kernel
from kernels import native


@pytest.mark.skipif(not native.load(), reason="CPU kernels could not be built here")
def test_a_toy_layer_prints_every_step_with_its_ratios(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich: one line per row
    toy = ["--hidden", "64", "--intermediate", "96", "--heads", "4", "--kv-heads", "2"]
    lora_kernel.main([*toy, "--iters", "1", "--rounds", "1", "--shapes", "2,4", "--rank", "8"])
    out = capsys.readouterr().out
    assert "decode 64, 1 adapter" in out and "decode 64, 40 adapters" in out
    assert "prefill" not in out  # only the shapes asked for
    assert out.count("x faster") == 2 and "ranks [8] (mean 8)" in out
