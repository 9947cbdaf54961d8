"""owners: projects, comparisons and runs belong to a writer

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 17:10:00

Rows that exist before this migration belong to the local writer ("local"): a single-user database upgrades with
its projects intact and visible, as before.
"""

from alembic import op
import sqlalchemy as sa

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TABLES = ("projects", "comparisons", "runs")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("owner", sa.String(length=100), server_default="local", nullable=False))
            batch.create_index(batch.f(f"ix_{table}_owner"), ["owner"], unique=False)


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_index(batch.f(f"ix_{table}_owner"))
            batch.drop_column("owner")
