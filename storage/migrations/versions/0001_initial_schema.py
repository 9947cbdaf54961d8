"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30 09:22:40.879112
"""

from alembic import op
import sqlalchemy as sa

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "projects",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("title", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("premise", sa.Text(), nullable=False),
        sa.Column("settings", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_projects"))
    )
    op.create_table(
        "worker_states",
        sa.Column("worker_id", sa.String(length=100), nullable=False),
        sa.Column("state", sa.String(length=40), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("model", sa.String(length=500), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("worker_id", name=op.f("pk_worker_states"))
    )
    op.create_table(
        "chapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("title", sa.String(length=200), nullable=False),
        sa.Column("instructions", sa.Text(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("word_count", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], name=op.f("fk_chapters_project_id_projects"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_chapters"))
    )
    op.create_index("ix_chapters_project_position", "chapters", ["project_id", "position"])

    op.create_table(
        "comparisons",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("settings", sa.Text(), nullable=False),
        sa.Column("ar_run_id", sa.Integer(), nullable=True),
        sa.Column("tokenswift_run_id", sa.Integer(), nullable=True),
        sa.Column("tokens_match", sa.Boolean(), nullable=True),
        sa.Column("first_divergence", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], name=op.f("fk_comparisons_project_id_projects"), ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_comparisons"))
    )
    op.create_index(op.f("ix_comparisons_project_id"), "comparisons", ["project_id"])

    op.create_table(
        "chapter_revisions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("chapter_id", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("reason", sa.String(length=40), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["chapter_id"], ["chapters.id"], name=op.f("fk_chapter_revisions_chapter_id_chapters"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_chapter_revisions"))
    )
    op.create_index(op.f("ix_chapter_revisions_chapter_id"), "chapter_revisions", ["chapter_id"])

    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("chapter_id", sa.Integer(), nullable=True),
        sa.Column("comparison_id", sa.Integer(), nullable=True),
        sa.Column("mode", sa.String(length=20), nullable=False),
        sa.Column("method", sa.String(length=20), nullable=False),
        sa.Column("model", sa.String(length=500), nullable=False),
        sa.Column("heads", sa.String(length=500), nullable=True),
        sa.Column("settings", sa.Text(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("worker_id", sa.String(length=100), nullable=True),
        sa.Column("queued_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=True),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("prefill_s", sa.Double(), nullable=True),
        sa.Column("decode_s", sa.Double(), nullable=True),
        sa.Column("tokens_per_s", sa.Double(), nullable=True),
        sa.Column("mean_accepted", sa.Double(), nullable=True),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("token_ids", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["chapter_id"], ["chapters.id"], name=op.f("fk_runs_chapter_id_chapters"), ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["comparison_id"], ["comparisons.id"], name=op.f("fk_runs_comparison_id_comparisons"), ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], name=op.f("fk_runs_project_id_projects"), ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs"))
    )
    op.create_index(op.f("ix_runs_chapter_id"), "runs", ["chapter_id"])
    op.create_index(op.f("ix_runs_comparison_id"), "runs", ["comparison_id"])
    op.create_index(op.f("ix_runs_project_id"), "runs", ["project_id"])
    op.create_index("ix_runs_status_queued_at", "runs", ["status", "queued_at", "id"])

    op.create_table(
        "step_metrics",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("new_tokens", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("from_ngram", sa.Integer(), nullable=False),
        sa.Column("tree_size", sa.Integer(), nullable=False),
        sa.Column("step_ms", sa.Double(), nullable=False),
        sa.Column("tokens_so_far", sa.Integer(), nullable=False),
        sa.Column("tokens_per_s", sa.Double(), nullable=True),
        sa.Column("repetition", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_step_metrics_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "step", name=op.f("pk_step_metrics"))
    )


def downgrade() -> None:
    # Dropping a table drops its indexes too.
    op.drop_table("step_metrics")
    op.drop_table("runs")
    op.drop_table("chapter_revisions")
    op.drop_table("comparisons")
    op.drop_table("chapters")
    op.drop_table("worker_states")
    op.drop_table("projects")
