"""`loragate-bench batch` end to end at toy size, as a user runs it: its own `loragate serve`
on a fresh database, a tenant and key made with the CLI, a batch through the Files and Batch
APIs beside streamed chats. The figures mean nothing here; every request must be answered and
the table whole."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from rich_tables import rows_starting

from bench.__main__ import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_batch_bench_runs_a_batch_alone_and_beside_chats(
    demo_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main([
        "batch", "--model", str(demo_model_dir), "--lines", "48", "--output-len", "4",
        "--interactive-output-len", "4", "--rate", "8", "--duration", "1",
        "--port", str(_free_port()), "--max-num-seqs", "8", "--batch-max-concurrency", "2",
        "--rounds", "2",
    ])  # fmt: skip
    out = capsys.readouterr().out
    [alone] = rows_starting(out, "interactive alone")
    [batch] = rows_starting(out, "batch alone")
    [together] = rows_starting(out, "together")
    assert int(alone[1]) > 0 and alone[5] == "0"
    assert float(alone[2]) <= float(alone[3]) <= float(alone[4])  # p50, p95, p99
    assert batch[5] == "0" and int(batch[7]) > 0
    assert together[5] == "0" and int(together[7]) > 0
    assert "TTFT p95" in together[8] and "x" in together[8]
    assert "2 rounds" in out and "each round" in out
    assert out.count("x / ") == 2  # one pair of ratios per round
