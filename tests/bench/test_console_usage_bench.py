"""`loragate-bench console-usage` at toy size on the suite's PostgreSQL server: it fills a
database of its own (and drops it), times the console's four queries at 0004 and at 0005, and
prints them in one table. The figures mean nothing here; the table must come out whole."""

from __future__ import annotations

import pytest
from rich_tables import table_rows

from bench.__main__ import main


def test_console_usage_at_toy_size(postgres_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`postgres_url` is here to skip, or fail in CI, as the suite does without a server; the
    bench makes its own database beside it."""
    import psycopg

    server = postgres_url.rsplit("/", 1)[0] + "/postgres"

    def bench_databases() -> set[str]:
        with psycopg.connect(postgres_url) as conn:
            query = "SELECT datname FROM pg_database WHERE datname LIKE 'loragate_bench_%'"
            return {name for (name,) in conn.execute(query)}

    before = bench_databases()
    main([
        "console-usage", "--database-url", server, "--rows", "2000", "--tenants", "60",
        "--repeat", "1",
    ])  # fmt: skip
    assert bench_databases() <= before  # its database dropped
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [row[0] for row in rows] == [
        "day x tenant, top 10",
        "day x model, top 10",
        "day x adapter, top 10",
        "tenants page of 50, month_tokens",
    ]
    for _, without, with_, ratio in rows:
        assert float(without.replace(",", "")) > 0 and float(with_.replace(",", "")) > 0
        assert float(ratio) > 0
    assert "2,000 rows" in out and "filled in" in out
