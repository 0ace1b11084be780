"""Several base models: a tenant's `allowed_models` (null: every model), and adapters named
uniquely per base model, so that one owner may have an adapter of one name on two models.

Downgrading puts back one name per owner: it refuses, before it changes anything, while an
owner has one name on two base models (delete one of them first). Checked first because
SQLite does not undo a half-done table copy: the failed copy would be left behind.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-08 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("allowed_models", sa.JSON(), nullable=True))

    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.drop_constraint("uq_adapters_scope_name", type_="unique")
        batch_op.create_unique_constraint(
            "uq_adapters_scope_base_model_name", ["scope", "base_model", "name"]
        )


def downgrade() -> None:
    adapters = sa.table("adapters", sa.column("scope"), sa.column("name"))
    shared = op.get_bind().execute(
        sa.select(adapters.c.scope, adapters.c.name)
        .group_by(adapters.c.scope, adapters.c.name)
        .having(sa.func.count() > 1)
        .order_by(adapters.c.scope, adapters.c.name)
    )
    clashes = [f"{scope}/{name}" for scope, name in shared]
    if clashes:
        raise RuntimeError(
            "cannot go below 0003: these adapters (scope/name) exist on several base models, "
            f"which 0002 cannot hold: {', '.join(clashes[:20])}"
        )
    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.drop_constraint("uq_adapters_scope_base_model_name", type_="unique")
        batch_op.create_unique_constraint("uq_adapters_scope_name", ["scope", "name"])

    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("allowed_models")
