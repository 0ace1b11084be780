"""`loragate-bench coldstart` at toy size on the demo model: engine processes started from
nothing to their first token, with and without an adapter to load first, and in a warm spare
(`--spare`); every phase is measured in every round, and the report has its rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich_tables import table_rows

from bench.__main__ import main
from bench.coldstart import PHASES
from bench.coldstart_gateway import SCENARIOS


@pytest.mark.parametrize("with_adapter", [False, True])
def test_coldstart_measures_every_phase(
    with_adapter: bool,
    demo_model_dir: Path,
    demo_adapters: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "coldstart.json"
    args = ["coldstart", "--model", str(demo_model_dir), "--rounds", "1", "--dtype", "float32"]
    args += ["--kv-cache-memory", str(16 << 20), "--json", str(out)]
    # With the adapter, the weights from the checkpoint; without, mapped from a cache that
    # the untimed round wrote.
    cache = "none" if with_adapter else str(tmp_path / "weights")
    args += ["--weights-cache-dir", cache]
    if with_adapter:
        args += ["--adapter", str(demo_adapters["r8-all"])]
    main(args)
    result = json.loads(out.read_text())
    (phases,) = result["rounds"]
    engine_side = set(PHASES) - {"gateway", "first token", "cache"}
    if not with_adapter:
        engine_side -= {"prepack"}  # nothing to reorder: the file holds the reordered weights
        assert "prepack" not in phases and "cache" not in phases
        assert list((tmp_path / "weights").glob("*.weights"))
    assert engine_side <= set(phases), phases  # the engine process reported each phase
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases["process"] > 0 and phases["weights"] > 0 and phases["first token"] > 0
    size = sum(f.stat().st_size for f in demo_model_dir.glob("*.safetensors"))
    assert result["weights_bytes"] == size and result["cat_seconds"] > 0
    printed = capsys.readouterr().out
    rows = table_rows(printed)
    assert [row[0] for row in rows] == [*PHASES, "to the first token"], printed
    assert "of cat's speed" in printed
    source = "read from the checkpoint" if with_adapter else "mapped from the weights cache"
    assert f"weights {source}" in printed


def test_coldstart_with_a_warm_spare(
    demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--spare`: each round also in a spare started ahead; both columns, and the spare's
    resident memory."""
    out = tmp_path / "coldstart.json"
    args = ["coldstart", "--model", str(demo_model_dir), "--rounds", "1", "--dtype", "float32"]
    main([*args, "--kv-cache-memory", str(16 << 20), "--spare", "--json", str(out)])
    result = json.loads(out.read_text())
    (fresh,) = result["rounds"]
    (spare,) = result["spare_rounds"]
    assert set(spare) == set(fresh) and all(seconds >= 0 for seconds in spare.values())
    assert result["spare_rss_bytes"] > 0
    printed = capsys.readouterr().out
    rows = table_rows(printed)
    assert [row[0] for row in rows] == [*PHASES, "to the first token"], printed
    assert all(len(row) == 5 for row in rows)  # the phase, then seconds and share for each
    assert "in a warm spare" in printed and "of cat's speed" in printed


def test_coldstart_from_the_zygote(
    demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--zygote`: each round also forked from a zygote; its column, the fork's time and the
    zygote's memory (RSS, PSS)."""
    out = tmp_path / "coldstart.json"
    args = ["coldstart", "--model", str(demo_model_dir), "--rounds", "1", "--dtype", "float32"]
    main([*args, "--kv-cache-memory", str(16 << 20), "--zygote", "--json", str(out)])
    result = json.loads(out.read_text())
    (fresh,) = result["rounds"]
    (forked,) = result["zygote_rounds"]
    assert set(forked) == set(fresh) and forked["process"] > 0
    assert result["zygote_memory"]["rss"] >= result["zygote_memory"]["pss"] > 0
    printed = capsys.readouterr().out
    assert all(len(row) == 5 for row in table_rows(printed))
    words = " ".join(printed.split())  # the console wraps its lines
    assert "from the zygote:" in words and "the fork and its arguments" in words


def test_coldstart_through_the_gateway(
    demo_model_dir: Path, tmp_path: Path, tcp_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--gateway`: one round of every scenario through `loragate serve` (no baseline here:
    it only repeats the same with every engine spawned, seconds each)."""
    out = tmp_path / "gateway.json"
    args = ["coldstart", "--gateway", "--model", str(demo_model_dir), "--rounds", "1"]
    args += ["--port", str(tcp_port), "--no-baseline", "--settle", "0.5"]
    main([*args, "--dtype", "float32", "--json", str(out)])
    result = json.loads(out.read_text())
    (times,) = result["rounds"]["zygote"]
    assert set(times) == set(SCENARIOS) and all(seconds > 0 for seconds in times.values())
    assert result["zygote_memory"]["pss"] > 0
    printed = capsys.readouterr().out
    assert [row[0] for row in table_rows(printed)] == list(SCENARIOS), printed
