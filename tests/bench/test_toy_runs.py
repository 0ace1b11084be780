"""Every offline benchmark runs end to end at toy size on the demo model, so that none rots
between the sessions that measure with it. The figures mean nothing here; the tables must
come out whole, and where a bench reports counts (schemas, rows, pairs, documents) they must
be what was asked, with no errors. Below the listing's set: `guided --schemas`, and the
benches run as `python -m bench.NAME` (ratelimit on Redis, ledger on SQLite and PostgreSQL,
guided_backends with llguidance). (`serve`, `tools` and `upload` drive a server:
test_server_benches.py; `kernels --toy` is in test_kernels_bench.py; `vs-vllm` needs a vLLM
server, and only its option parsing is checked, in test_bench_cli.py.)"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from rich_tables import rows_starting, table_rows

from bench.__main__ import main

TOY_RUNS = {
    "offline": ["--num-prompts", "4", "--output-len", "4", "--batch-size", "4"],
    "lora": [
        "--num-adapters", "2", "--num-prompts", "4", "--output-len", "4", "--batch-size", "4",
        "--repeat", "1",
    ],
    "containment": ["--batches", "4", "--output-len", "12", "--fail-at", "4", "--repeat", "1"],
    "guided": ["--num-prompts", "4", "--output-len", "24"],
    "spec-decode": ["--repeat", "1", "--max-num-seqs", "2", "--dtype", "float32"],
    "quantization": ["--repeat", "1", "--max-tokens", "4", "--dtype", "float32"],
    "agreement": ["--max-tokens", "4", "--dtype", "float32"],
    "fairness": ["--duration", "1", "--drain", "10", "--output-len", "4", "--rounds", "1"],
}  # fmt: skip


@pytest.mark.parametrize("name", list(TOY_RUNS))
def test_each_benchmark_runs_at_toy_size(
    name: str, demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [name, "--model", str(demo_model_dir), *TOY_RUNS[name]]
    if name == "lora":
        args += ["--adapters-dir", str(tmp_path / "adapters")]
    main(args)
    out = capsys.readouterr().out
    assert "┃" in out or "|" in out, out[-2000:]  # a table was printed


# -- the benchmarks outside the listing's offline set --------------------------------------------

SCHEMAS = Path(__file__).parents[1] / "data" / "schemas"


def test_guided_schemas(
    demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`guided --schemas`: the first 7 schemas by name, 16 tokens. `air` names an external $ref
    (refused); the others compile, and what finishes is valid: an INVALID one is a bug."""
    out = tmp_path / "schemas.json"
    main([
        "guided", "--schemas", str(SCHEMAS), "--model", str(demo_model_dir), "--limit", "7",
        "--max-tokens", "16", "--threads", "1", "--json", str(out),
    ])  # fmt: skip
    result = json.loads(out.read_text())
    rows = {row["name"]: row for row in result["schemas"]}
    assert len(rows) == 7 and sum(result["counts"].values()) == 7
    assert rows["air"]["outcome"] == "refused" and "external reference" in rows["air"]["reason"]
    assert result["counts"]["refused"] == 1
    assert result["counts"]["valid"] + result["counts"]["length"] == 6  # no INVALID, no error
    for row in rows.values():
        if row["outcome"] == "length":
            assert row["num_tokens"] == 16
        elif row["outcome"] == "valid":
            assert 1 <= row["num_tokens"] <= 16 and json.loads(row["text"]) is not None
    assert result["compile_ms_p50"] is not None and result["guided"]["tokens"] > 0
    assert result["unguided"]["tokens"] == result["guided"]["tokens"]  # the same work
    printed = capsys.readouterr().out
    assert rows_starting(printed, "refused with a 400")[0][1] == "1 (14%)"
    assert rows_starting(printed, "finished and INVALID")[0][1] == "0 (0%)"
    assert rows_starting(printed, "guided") and rows_starting(printed, "unguided")


def test_guided_schemas_judges_documents_by_the_schema() -> None:
    """check_document, the bench's verdict on a finished document, and refusal_group."""
    from bench.guided_schemas import check_document, refusal_group

    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}}
    assert check_document(schema, '{"n": 2}') == ("valid", [], "")
    outcome, keywords, why = check_document(schema, '{"n": 5}')
    assert (outcome, keywords) == ("INVALID", ["maximum"]) and why.startswith("maximum at /n")
    assert check_document(schema, '{"n": ')[:2] == ("INVALID", ["json"])
    external = {"$ref": "https://example.com/nowhere.json"}
    assert check_document(external, "{}")[0] == "not checkable"
    assert refusal_group("the pattern 'a-very-long-pattern-name-here-x' at /a/b/0, 12 s") == (
        "the pattern '…' at … N s"
    )  # the same refusal in two schemas reads the same


def test_ratelimit_in_process_and_on_redis(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m bench.ratelimit`: both limiters, 1 and 4 tasks, 0.2 s a row; the keys it made
    in Redis are gone afterwards."""
    import redis

    from bench import ratelimit

    rows: list[ratelimit.Row] = []

    async def recorded(args: object) -> list[ratelimit.Row]:
        rows.extend(await bench(args))
        return rows

    bench = ratelimit.bench
    monkeypatch.setattr(ratelimit, "bench", recorded)
    admin = redis.Redis.from_url(redis_url)
    keys_before = set(admin.scan_iter(match="bench-ratelimit-*"))
    args = ["--redis-url", redis_url, "--seconds", "0.2", "--concurrency", "4", "--tenants", "3"]
    ratelimit.main(args)
    assert set(admin.scan_iter(match="bench-ratelimit-*")) <= keys_before
    admin.close()

    expected = [("local", 1), ("local", 4), ("redis PING x2", 1), ("redis", 1), ("redis", 4)]
    assert [(row.limiter, row.tasks) for row in rows] == expected
    for row in rows:
        assert row.pairs > 0 and len(row.latencies) == row.pairs
        if row.limiter != "redis PING x2":
            assert len(row.acquire_latencies) == row.pairs
    for row in rows[3:]:
        # one script per acquire and one per release; another client of this Redis only adds
        assert row.evalsha_per_pair >= 2 and row.evalsha_per_round_trip >= 1
    printed = capsys.readouterr().out
    assert [r[:2] for r in table_rows(printed)] == [[name, str(n)] for name, n in expected]
    assert "Redis adds" in printed


def test_ratelimit_local_only(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import ratelimit

    ratelimit.main(["--redis-url", "none", "--seconds", "0.1", "--concurrency", "2"])
    printed = capsys.readouterr().out
    assert [r[:2] for r in table_rows(printed)] == [["local", "1"], ["local", "2"]]
    assert "Redis adds" not in printed


def test_ledger_on_sqlite_and_postgresql(
    postgres_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m bench.ledger` at 200 rows, 3 records per writer. It makes (and drops) a
    database of its own on the PostgreSQL server the suite uses ($LORAGATE_TEST_POSTGRES);
    `postgres_url` is here to skip, or fail in CI, as the suite does without one."""
    import psycopg

    from bench import ledger

    def bench_databases() -> set[str]:
        with psycopg.connect(postgres_url) as conn:
            query = "SELECT datname FROM pg_database WHERE datname LIKE 'loragate_bench_%'"
            return {name for (name,) in conn.execute(query)}

    before = bench_databases()
    ledger.main(
        ["--rows", "200", "--records", "3", "--batch-size", "50", "--spool-dir", str(tmp_path)]
    )
    assert bench_databases() <= before  # its database dropped
    assert not any(tmp_path.iterdir())  # its spools and SQLite file removed
    rows = table_rows(capsys.readouterr().out)
    assert [row[:1] + row[2:3] for row in rows] == [
        ["SQLite", "1"], ["", "64"], ["PostgreSQL", "1"], ["", "64"]
    ]  # fmt: skip
    for row in rows:
        p50, p99, fsyncs = map(float, row[3:])
        assert 0 < p50 <= p99 and 0 < fsyncs <= 1  # a record waits for at most one fsync
    assert all(float(row[1].replace(",", "")) > 0 for row in rows[::2])  # write rows/s


def test_ledger_writes_every_spooled_row(database_url: str, tmp_path: Path) -> None:
    """write_throughput, the bench's first figure: every row it spooled is in the database
    after its flush, and the spool is empty."""
    import asyncio

    from sqlalchemy import func, select

    from bench.ledger import write_throughput
    from tenants.db import Database, upgrade
    from tenants.models import Usage

    upgrade(database_url)
    spool = tmp_path / "spool"
    assert asyncio.run(write_throughput(database_url, spool, 300, 64)) > 0

    async def count() -> int:
        db = Database(database_url)
        try:
            async with db.session() as session:
                return int(await session.scalar(select(func.count()).select_from(Usage)))
        finally:
            await db.close()

    assert asyncio.run(count()) == 300
    assert not [p for p in spool.rglob("*") if p.is_file() and p.stat().st_size]


def test_guided_backends(
    demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m bench.guided_backends`: xgrammar against llguidance on five schemas (one
    neither takes, one only xgrammar takes, three both do), six documents each."""
    from bench import guided_backends

    schemas = tmp_path / "schemas"
    schemas.mkdir()
    names = ["air", "artifacthub-repo", "lego", "minecraft-lang", "stylua"]
    for name in names:
        shutil.copy(SCHEMAS / f"{name}.json", schemas)
    out = tmp_path / "backends.json"
    guided_backends.main([
        "--schemas", str(schemas), "--tokenizer", str(demo_model_dir), "--max-docs", "6",
        "--json", str(out),
    ])  # fmt: skip
    result = json.loads(out.read_text())
    assert [row["name"] for row in result["rows"]] == names
    summary = result["summary"]
    assert summary["schemas"] == 5
    for backend in ("xgrammar", "llguidance"):
        totals = summary[backend]
        assert 1 <= totals["accepted"] < 5 and totals["documents_checked"] > 0
        assert totals["mask_mismatches"] == 0  # each mask allows exactly what the matcher takes
    assert summary["xgrammar"]["wrong_accepts_silent"] == 0  # no invalid document let through
    air = result["rows"][0]["backends"]
    assert not air["xgrammar"]["accepted"] and not air["llguidance"]["accepted"]
    printed = capsys.readouterr().out
    assert rows_starting(printed, "schemas accepted")[0][1:] == [
        f"{summary['xgrammar']['accepted']} of 5", f"{summary['llguidance']['accepted']} of 5"
    ]  # fmt: skip
    assert [row[1] for row in rows_starting(printed, "air")[:1]] == ["0/0"]


def test_guided_backends_says_how_to_install_llguidance(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import guided_backends

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance: ImportError
    with pytest.raises(SystemExit) as exit_:
        guided_backends.main(["--schemas", str(SCHEMAS)])
    assert exit_.value.code == guided_backends.INSTALL_HINT
