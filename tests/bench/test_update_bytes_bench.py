"""`loragate-bench update-bytes` at toy size: both ways of carrying the text are measured on the
same steps, and the deltas take fewer bytes than the whole texts."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich_tables import table_rows

from bench.__main__ import main


def test_update_bytes_compares_deltas_with_whole_texts(
    demo_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["update-bytes", "--model", str(demo_model_dir), "--sequences", "2", "--max-tokens", "40"])
    printed = capsys.readouterr().out
    rows = {row[0]: row for row in table_rows(printed)}
    whole = int(rows["the whole text (before)"][1].replace(",", ""))
    delta = int(rows["the text appended"][1].replace(",", ""))
    assert 0 < delta < whole
    assert "fewer bytes" in printed
