"""Initial schema: devices, templates, problems, runs, trials, best configs.

Revision ID: 0001
Revises:
Create Date: 2025-01-20 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ_DATETIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "ft_devices",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("compute_capability", sa.String(32), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("shared_mem_per_block", sa.BigInteger(), nullable=False),
        sa.Column("total_memory", sa.BigInteger(), nullable=False),
        sa.Column("created_at", TZ_DATETIME, nullable=False),
        sa.UniqueConstraint("name", "compute_capability", "sm_count", "shared_mem_per_block",
                            "total_memory", name="uq_ft_devices_hardware"),
    )
    op.create_table(
        "ft_templates",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("source_hash", sa.String(64), nullable=False),
        sa.Column("created_at", TZ_DATETIME, nullable=False),
        sa.UniqueConstraint("name", "source_hash", name="uq_ft_templates_name_source_hash"),
    )
    op.create_table(
        "ft_problems",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("template_name", sa.String(200), nullable=False),
        sa.Column("key_json", sa.Text(), nullable=False),
        sa.Column("bucket", sa.String(200), nullable=False),
        sa.Column("created_at", TZ_DATETIME, nullable=False),
        sa.UniqueConstraint("template_name", "key_json", name="uq_ft_problems_template_key"),
    )
    op.create_index("ix_ft_problems_bucket", "ft_problems", ["bucket"])
    op.create_table(
        "ft_runs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("device_id", sa.Integer(), sa.ForeignKey("ft_devices.id"), nullable=False),
        sa.Column("template_id", sa.Integer(), sa.ForeignKey("ft_templates.id"), nullable=False),
        sa.Column("problem_id", sa.Integer(), sa.ForeignKey("ft_problems.id"), nullable=False),
        sa.Column("study_name", sa.String(300), nullable=False),
        sa.Column("sampler", sa.String(100), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=True),
        sa.Column("params_json", sa.Text(), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("started_at", TZ_DATETIME, nullable=False),
        sa.Column("finished_at", TZ_DATETIME, nullable=True),
        sa.Column("flashtune_version", sa.String(64), nullable=False),
        sa.Column("torch_version", sa.String(64), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("cuda_version", sa.String(64), nullable=False),
    )
    op.create_table(
        "ft_trials",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("ft_runs.id"), nullable=False),
        sa.Column("device_id", sa.Integer(), sa.ForeignKey("ft_devices.id"), nullable=False),
        sa.Column("template_id", sa.Integer(), sa.ForeignKey("ft_templates.id"), nullable=False),
        sa.Column("problem_id", sa.Integer(), sa.ForeignKey("ft_problems.id"), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("config_hash", sa.String(16), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("median_ms", sa.Float(), nullable=True),
        sa.Column("tflops", sa.Float(), nullable=True),
        sa.Column("compile_s", sa.Float(), nullable=True),
        sa.Column("started_at", TZ_DATETIME, nullable=False),
        sa.Column("finished_at", TZ_DATETIME, nullable=True),
        sa.UniqueConstraint("run_id", "number", name="uq_ft_trials_run_number"),
        sa.UniqueConstraint("device_id", "template_id", "problem_id", "number",
                            name="uq_ft_trials_study_number"),
    )
    op.create_index("ix_ft_trials_study_config", "ft_trials",
                    ["device_id", "template_id", "problem_id", "config_hash"])
    op.create_table(
        "ft_best_configs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("device_id", sa.Integer(), sa.ForeignKey("ft_devices.id"), nullable=False),
        sa.Column("template_id", sa.Integer(), sa.ForeignKey("ft_templates.id"), nullable=False),
        sa.Column("problem_id", sa.Integer(), sa.ForeignKey("ft_problems.id"), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("median_ms", sa.Float(), nullable=False),
        sa.Column("tflops", sa.Float(), nullable=True),
        sa.Column("trial_id", sa.Integer(), sa.ForeignKey("ft_trials.id", ondelete="SET NULL"),
                  nullable=True),
        sa.Column("trials_count", sa.Integer(), nullable=False),
        sa.Column("tuned_at", TZ_DATETIME, nullable=False),
        sa.UniqueConstraint("device_id", "template_id", "problem_id",
                            name="uq_ft_best_configs_study"),
    )


def downgrade() -> None:
    op.drop_table("ft_best_configs")
    op.drop_index("ix_ft_trials_study_config", table_name="ft_trials")
    op.drop_table("ft_trials")
    op.drop_table("ft_runs")
    op.drop_index("ix_ft_problems_bucket", table_name="ft_problems")
    op.drop_table("ft_problems")
    op.drop_table("ft_templates")
    op.drop_table("ft_devices")
