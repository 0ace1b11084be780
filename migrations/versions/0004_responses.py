"""The Responses API: stored responses per tenant (`responses`), and the API each usage row
came through (`usage.endpoint`; null for the rows written before).

`responses.previous_response_id` has no foreign key: the previous response may expire before
the ones that continue it. `heartbeat_at` is when the gateway running a background response
last said it still runs it: one that falls silent has stopped, whichever gateway it was.
Downgrading drops every stored response.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-15 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=True),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("background", sa.Boolean(), nullable=False),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("output", sa.JSON(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("responses", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_responses_tenant_id"), ["tenant_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_responses_expires_at"), ["expires_at"], unique=False)
        batch_op.create_index(
            "ix_responses_tenant_id_created_at", ["tenant_id", "created_at"], unique=False
        )

    with op.batch_alter_table("usage", schema=None) as batch_op:
        batch_op.add_column(sa.Column("endpoint", sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage", schema=None) as batch_op:
        batch_op.drop_column("endpoint")

    with op.batch_alter_table("responses", schema=None) as batch_op:
        batch_op.drop_index("ix_responses_tenant_id_created_at")
        batch_op.drop_index(batch_op.f("ix_responses_expires_at"))
        batch_op.drop_index(batch_op.f("ix_responses_tenant_id"))

    op.drop_table("responses")
