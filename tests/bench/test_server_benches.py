"""The benchmarks that drive a server (`serve`, `tools`, `upload`) run end to end at toy size
against a live server on the demo model (tests/gateway/live_server.py: a tenancy, a tenant's
key, an admin token), through `loragate-bench NAME` as a user runs them. The figures mean
nothing here; the counts must hold: every request asked for answered, none failed, every
forced tool call valid, the tables whole."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rich_tables import rows_starting

from bench.__main__ import main
from bench.tool_calls import MODES

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))  # live_server lives there
from live_server import (  # noqa: E402
    Server,
    build_test_app,
    live_server,
    lora_engine,
    register_public,
)

ADAPTERS = ("r4-attn", "r8-all")


@pytest.fixture(scope="module")
def server(
    demo_model_dir: Path, demo_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One server for the module, as live_server's demo_server but with LoRA (serve's w3 runs
    over adapters), a hermes tool-call parser (tools) and two public adapters."""
    engine = lora_engine(demo_model_dir)
    root = tmp_path_factory.mktemp("bench-server")
    app = build_test_app(engine, "demo", root, demo_model_dir, tool_call_parser="hermes")
    try:
        with live_server(app, engine) as server:
            for name in ADAPTERS:
                register_public(server.app, name, demo_adapters[name])
            yield server
    finally:
        asyncio.run(engine.shutdown(0))


def serve(server: Server, tmp_path: Path, *args: str, api_key: str | None = None) -> dict:
    """`loragate-bench serve` at toy size against `server`; its JSON row."""
    out = tmp_path / "serve.json"
    main([
        "serve", "--base-url", server.base_url, "--model", "demo",
        "--api-key", api_key or server.tenancy.api_key, "--vocab-size", "8192",
        "--concurrency", "2", "--num-prompts", "4", "--output-len", "4", "--warmup", "1",
        "--json", str(out), *args,
    ])  # fmt: skip
    return json.loads(out.read_text())


@pytest.mark.parametrize("workload", ["w1", "w3", "wv"])
def test_serve_runs_each_workload(
    server: Server, workload: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = serve(server, tmp_path, "--workload", workload, "--adapters", ",".join(ADAPTERS))
    assert (row["completed"], row["failed"], row["errors"]) == (4, 0, [])
    assert (row["workload"], row["num_prompts"], row["output_len"]) == (workload, 4, 4)
    assert row["output_tok_s"] > 0 and 0 < row["ttft_p50_s"] <= row["e2e_p50_s"]
    assert "mfu" not in row  # no --model-dir
    [printed] = rows_starting(capsys.readouterr().out, "server")
    assert printed[1:4] == [workload, "2", "4/0"] and printed[-1] == "-"


def test_serve_with_the_model_dir_adds_mfu(
    server: Server, demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = serve(server, tmp_path, "--model-dir", str(demo_model_dir), "--label", "demo")
    assert (row["completed"], row["failed"]) == (4, 0)
    assert row["dtype"] == "float32" and row["peak_flops"] > 0 and 0 < row["mfu"] < 1
    [printed] = rows_starting(capsys.readouterr().out, "demo")
    assert printed[3] == "4/0" and printed[-1].endswith("%")


def test_serve_reports_failed_requests(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong key: every request fails with the server's 401, counted and shown, no crash."""
    row = serve(server, tmp_path, "--warmup", "0", api_key="not-a-key")
    assert (row["completed"], row["failed"]) == (0, 4)
    assert len(row["errors"]) == 1 and row["errors"][0].startswith("HTTP 401")
    out = capsys.readouterr().out
    assert "4 requests failed" in out
    assert rows_starting(out, "server")[0][3] == "0/4"


def test_tools_forced_calls_are_all_valid(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tools.json"
    main([
        "tools", "--base-url", server.base_url, "--model", "demo",
        "--api-key", server.tenancy.api_key, "--samples", "2", "--repeats", "1",
        "--json", str(out),
    ])  # fmt: skip
    result = json.loads(out.read_text())
    assert list(result["validity"]) == list(MODES)
    for counts in result["validity"].values():
        assert counts["requests"] == 2
        assert counts["tool_calls"] + counts["length"] == 2  # forced: a call, or out of tokens
        assert counts["invalid calls"] == 0  # the grammar holds every call to its schema
        assert counts["valid calls"] >= counts["tool_calls"]
    for run in ("forced call", "guided JSON"):
        assert 0 < result["cost"][run]["tokens"] <= 96
    printed = capsys.readouterr().out
    assert rows_starting(printed, "forced call") and rows_starting(printed, "guided JSON")
    assert rows_starting(printed, "forced / guided")[0][1].endswith("x")


def test_upload_registers_and_deletes_again(
    server: Server, demo_adapters: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with httpx.Client(base_url=server.base_url, headers=server.admin_headers) as admin:
        before = admin.get("/admin/adapters").json()["data"]
        main([
            "upload", "--base-url", server.base_url, "--adapter", str(demo_adapters["r4-attn"]),
            "--repeat", "2", "--admin-token", server.tenancy.admin_token,
        ])  # fmt: skip
        after = admin.get("/admin/adapters").json()["data"]
    assert after == before  # the bench deleted what it uploaded
    [printed] = rows_starting(capsys.readouterr().out, "2")  # the uploads column
    assert len(printed) == 5 and all(cell.isdigit() for cell in printed)


def test_upload_needs_an_admin_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LORAGATE_ADMIN_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["upload", "--adapter", "unused"])
    assert exit_.value.code == 2
    assert "an admin token is needed" in capsys.readouterr().err
