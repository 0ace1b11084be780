"""`loragate-bench linears` runs end to end at toy shapes and prints its table."""

from __future__ import annotations

import re

import pytest

from bench import linears
from kernels import linear, native


@pytest.mark.skipif(not native.load(), reason="CPU kernels could not be built here")
def test_toy_shapes_print_every_kernel_and_the_ratio(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich: one line per row
    linears.main(["--threads", "1", "--iters", "2", "--shapes", "3x16x40,1x8x20"])
    out = capsys.readouterr().out
    assert "3 x 16 x 40" in out and "1 x 8 x 20" in out
    ratios = re.findall(r"\d+\.\d\dx", out)
    assert len(ratios) == (2 if linear.available() else 0)
    assert "16 x 256 x 512" not in out  # only the shapes asked for


def test_shapes_parse_as_rows_inputs_outputs() -> None:
    assert linears.parse_shapes("16x256x512,1X8X9") == [(16, 256, 512), (1, 8, 9)]
