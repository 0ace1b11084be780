"""Usage: one append-only row per request, what billing sums (no foreign keys: a billing row
outlives the tenant, key or adapter it names).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=True),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("adapter_name", sa.String(length=128), nullable=True),
        sa.Column("adapter_sha256", sa.String(length=64), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("ttft", sa.Double(), nullable=True),
        sa.Column("latency", sa.Double(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_epoch", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("request_id"),
    )
    with op.batch_alter_table("usage", schema=None) as batch_op:
        batch_op.create_index("ix_usage_created_epoch", ["created_epoch"], unique=False)
        batch_op.create_index(
            "ix_usage_tenant_id_created_epoch", ["tenant_id", "created_epoch"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("usage", schema=None) as batch_op:
        batch_op.drop_index("ix_usage_tenant_id_created_epoch")
        batch_op.drop_index("ix_usage_created_epoch")

    op.drop_table("usage")
