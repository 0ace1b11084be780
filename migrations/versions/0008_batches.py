"""The Batch API: batches per tenant (`batches`) and their lines (`batch_lines`, by line
number within the batch), the batch a usage row was a line of (`usage.batch_id`, indexed: the
usage API groups and filters by it), and a tenant's cap on the tokens its unfinished batches
hold (`tenants.batch_token_limit`; null: the server's default).

Batches go with their tenant and lines with their batch (ON DELETE CASCADE; by hand too, as
SQLite enforces foreign keys only when asked to: tenants/tenants.py). `usage.batch_id` has no
foreign key: a billing row outlives what it names. Downgrading drops every batch.

Revision ID: 0008
Revises: 0007
Create Date: 2027-02-01 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=True),
        sa.Column("endpoint", sa.String(length=32), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=8), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        sa.Column("num_total", sa.BigInteger(), nullable=False),
        sa.Column("num_completed", sa.BigInteger(), nullable=False),
        sa.Column("num_failed", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("in_progress_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finalizing_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancelling_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finisher", sa.String(length=64), nullable=True),
        sa.Column("finish_until", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_batches_tenant_id"), ["tenant_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_batches_status"), ["status"], unique=False)
        batch_op.create_index(
            "ix_batches_tenant_id_created_at", ["tenant_id", "created_at"], unique=False
        )

    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("line", sa.BigInteger(), nullable=False),
        sa.Column("custom_id", sa.String(length=512), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("estimated_tokens", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("claimed_by", sa.String(length=64), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.BigInteger(), nullable=False),
        sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("batch_id", "line"),
    )
    with op.batch_alter_table("batch_lines", schema=None) as batch_op:
        batch_op.create_index(
            "ix_batch_lines_batch_id_status_line", ["batch_id", "status", "line"], unique=False
        )

    with op.batch_alter_table("usage", schema=None) as batch_op:
        batch_op.add_column(sa.Column("batch_id", sa.String(length=64), nullable=True))
        batch_op.create_index(batch_op.f("ix_usage_batch_id"), ["batch_id"], unique=False)

    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("batch_token_limit", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("batch_token_limit")

    with op.batch_alter_table("usage", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_usage_batch_id"))
        batch_op.drop_column("batch_id")

    with op.batch_alter_table("batch_lines", schema=None) as batch_op:
        batch_op.drop_index("ix_batch_lines_batch_id_status_line")
    op.drop_table("batch_lines")

    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_index("ix_batches_tenant_id_created_at")
        batch_op.drop_index(batch_op.f("ix_batches_status"))
        batch_op.drop_index(batch_op.f("ix_batches_tenant_id"))
    op.drop_table("batches")
