"""The Files API: files per tenant (`files`), their bytes on disk under the adapter store's root
(tenants/files.py), this table saying whose each is, what for (`batch`: a client's upload;
`batch_output`: what a batch wrote), its name, size and number of lines.

A tenant's files go with the tenant (ON DELETE CASCADE; SQLite enforces foreign keys only when
asked to, so tenants/tenants.py deletes by hand as well). Downgrading drops every file's row;
the bytes left on disk are removed by the next start's sweep.

Revision ID: 0007
Revises: 0006
Create Date: 2027-01-20 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("lines", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_files_tenant_id"), ["tenant_id"], unique=False)
        batch_op.create_index(
            "ix_files_tenant_id_created_at", ["tenant_id", "created_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_index("ix_files_tenant_id_created_at")
        batch_op.drop_index(batch_op.f("ix_files_tenant_id"))
    op.drop_table("files")
