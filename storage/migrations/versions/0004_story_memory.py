"""story memory: chapter summaries, a lorebook, outline and summary runs, what went into a prompt

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 23:00:00
"""

from alembic import op
import sqlalchemy as sa

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("projects") as batch:
        batch.add_column(sa.Column("lore_tokens", sa.Integer(), server_default="400", nullable=False))
        batch.add_column(sa.Column("auto_summary", sa.Boolean(), server_default=sa.true(), nullable=False))
    with op.batch_alter_table("chapters") as batch:
        batch.add_column(sa.Column("summary", sa.Text(), server_default="", nullable=False))
        batch.add_column(sa.Column("summary_source", sa.String(length=20), server_default="", nullable=False))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("summary_of", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("prompt_info", sa.Text(), nullable=True))
        batch.create_foreign_key(batch.f("fk_runs_summary_of_chapters"), "chapters", ["summary_of"], ["id"],
                                 ondelete="SET NULL")
        batch.create_index(batch.f("ix_runs_summary_of"), ["summary_of"], unique=False)
    op.create_table(
        "lore_entries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("keywords", sa.Text(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], name=op.f("fk_lore_entries_project_id_projects"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_lore_entries")),
    )
    op.create_index("ix_lore_entries_project_position", "lore_entries", ["project_id", "position"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_lore_entries_project_position", table_name="lore_entries")
    op.drop_table("lore_entries")
    with op.batch_alter_table("runs") as batch:
        batch.drop_index(batch.f("ix_runs_summary_of"))
        batch.drop_constraint(batch.f("fk_runs_summary_of_chapters"), type_="foreignkey")
        batch.drop_column("prompt_info")
        batch.drop_column("summary_of")
    with op.batch_alter_table("chapters") as batch:
        batch.drop_column("summary_source")
        batch.drop_column("summary")
    with op.batch_alter_table("projects") as batch:
        batch.drop_column("auto_summary")
        batch.drop_column("lore_tokens")
