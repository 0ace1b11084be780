"""The admin console's usage queries (issue 30): on PostgreSQL, the usage table's
(tenant_id, created_epoch) index carries the token sums (INCLUDE), and the day bucket has
statistics of its own.

- INCLUDE (prompt_tokens, cached_tokens, completion_tokens): a page of tenants' tokens this
  month, and a tenant's sums over any range, come from the index alone (an index-only scan), not
  from a heap fetch per row. SQLite's index stays the plain (tenant_id, created_epoch) it was.
- `CREATE STATISTICS usage_created_day` on `created_epoch - created_epoch % 86400` (what
  /admin/usage groups days by, tenants/usage.py): without it PostgreSQL takes every row for a
  day of its own, plans a million groups, and sums a year in one process instead of in
  parallel, about 1.5x slower (bench/console_usage.py measures both). PostgreSQL 14 and
  later; on older servers nothing is created. Statistics are not SQLAlchemy metadata:
  tenants/models.py names them in a comment only.

Indexes on (created_epoch) INCLUDE the grouped columns were measured too and left out: for a
year's range PostgreSQL reads the table itself (a scan of every row either way, and its cost
model prices a whole-index scan above the table's), so they would only cost writes. So was a
daily rollup: at the ledger's grain (day, tenant, model, adapter, key, endpoint) it keeps 87 %
of the bench's rows, a tenant making 2.7 requests a day on average.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-20 10:00:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

INDEX = "ix_usage_tenant_id_created_epoch"
SUMS = ["prompt_tokens", "cached_tokens", "completion_tokens"]
STATISTICS = "usage_created_day"
# Expression statistics came with PostgreSQL 14.
MIN_STATISTICS_VERSION = (14,)


def _postgresql() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def _has_expression_statistics() -> bool:
    version = op.get_bind().dialect.server_version_info or (0,)
    return tuple(version) >= MIN_STATISTICS_VERSION


def upgrade() -> None:
    if not _postgresql():
        return
    op.drop_index(INDEX, table_name="usage")
    op.create_index(INDEX, "usage", ["tenant_id", "created_epoch"], postgresql_include=SUMS)
    if _has_expression_statistics():
        op.execute(
            f"CREATE STATISTICS {STATISTICS} ON (created_epoch - created_epoch % 86400) FROM usage"
        )
        # Statistics are empty until the table is analyzed: now, not at autovacuum's leisure.
        op.execute("ANALYZE usage")


def downgrade() -> None:
    if not _postgresql():
        return
    op.execute(f"DROP STATISTICS IF EXISTS {STATISTICS}")
    op.drop_index(INDEX, table_name="usage")
    op.create_index(INDEX, "usage", ["tenant_id", "created_epoch"])
