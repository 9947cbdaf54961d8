"""project goal: a word-count goal per project

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 18:15:00
"""

from alembic import op
import sqlalchemy as sa

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("projects") as batch:
        batch.add_column(sa.Column("goal_words", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("projects") as batch:
        batch.drop_column("goal_words")
