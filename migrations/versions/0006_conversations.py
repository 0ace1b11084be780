"""The Conversations API: conversations per tenant (`conversations`) and their items in order
(`conversation_items`, by position within the conversation).

Both go with what owns them (ON DELETE CASCADE): a tenant's conversations with the tenant, a
conversation's items with the conversation. SQLite enforces foreign keys only when asked to,
so the code deletes by hand as well (tenants/conversations.py, tenants/tenants.py). An item's
id is unique within its conversation. Downgrading drops every conversation.

Revision ID: 0006
Revises: 0005
Create Date: 2027-01-10 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("next_position", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("conversations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_conversations_tenant_id"), ["tenant_id"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_conversations_expires_at"), ["expires_at"], unique=False
        )
        batch_op.create_index(
            "ix_conversations_tenant_id_expires_at", ["tenant_id", "expires_at"], unique=False
        )

    op.create_table(
        "conversation_items",
        sa.Column("conversation_id", sa.String(length=64), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("item_id", sa.String(length=64), nullable=False),
        sa.Column("item", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["conversation_id"], ["conversations.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("conversation_id", "position"),
        sa.UniqueConstraint(
            "conversation_id", "item_id", name="uq_conversation_items_conversation_id_item_id"
        ),
    )


def downgrade() -> None:
    op.drop_table("conversation_items")
    with op.batch_alter_table("conversations", schema=None) as batch_op:
        batch_op.drop_index("ix_conversations_tenant_id_expires_at")
        batch_op.drop_index(batch_op.f("ix_conversations_expires_at"))
        batch_op.drop_index(batch_op.f("ix_conversations_tenant_id"))
    op.drop_table("conversations")
