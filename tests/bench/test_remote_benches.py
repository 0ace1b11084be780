"""`loragate-bench remote-hop` and `loragate-bench routing` at toy size on the demo model: they
start `loragate engine`s and gateways as a user would, drive them, and report every setup. The
figures mean nothing here; every request must be answered and every setup reported."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.__main__ import main

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))  # live_server lives there
from live_server import free_port_run  # noqa: E402


def test_remote_hop_runs_every_setup(
    demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hop.json"
    main([
        "remote-hop", "--model", str(demo_model_dir), "--rounds", "1", "--num-prompts", "4",
        "--concurrency", "2", "--output-len", "4", "--port", str(free_port_run(8)),
        "--json", str(out),
    ])  # fmt: skip
    runs = json.loads(out.read_text())
    for side in ("local", "remote", "picker"):
        (row,) = runs[side]
        assert (row["completed"], row["failed"]) == (4, 0), row["errors"]
    printed = capsys.readouterr().out
    assert "remote / local output tok/s" in printed
    assert "picker / local output tok/s" in printed


def test_routing_runs_every_setup(
    demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "routing.json"
    main([
        "routing", "--model", str(demo_model_dir), "--tenants", "2", "--adapters-per-tenant", "1",
        "--system-tokens", "32", "--num-prompts", "6", "--concurrency", "2", "--output-len", "2",
        "--port", str(free_port_run(8)), "--adapter-dir", str(tmp_path / "adapters"),
        "--rounds", "1", "--json", str(out),
    ])  # fmt: skip
    runs = json.loads(out.read_text())
    assert set(runs) == {"single", "round_robin", "affinity"}
    for (row,) in runs.values():
        assert (row["completed"], row["failed"]) == (6, 0), row["errors"]
        assert 0 < row["hit_rate"] < 1  # a tenant's later requests find its prefix
        assert row["adapter_loads"] >= 2  # each tenant's adapter, loaded somewhere
    assert "affinity / round-robin output tok/s" in capsys.readouterr().out
