"""comparison divergence: vanilla decoding's draw where a comparison's runs first differ (position, tokens, top-2 gap)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04 03:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("comparisons") as batch:
        batch.add_column(sa.Column("divergence", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("comparisons") as batch:
        batch.drop_column("divergence")
