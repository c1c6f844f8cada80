"""Op choices: which implementation wins each shape of a user op on each device.

Until 0004 the database knew one best config per (device, template, problem): the fastest
config of ONE implementation. An op such as the attention forward now has several
implementations (the Triton ``attn_fwd``, a Gluon kernel, torch SDPA's backends as extern
implementations with no knobs), and the tuner times their leaders side by side; the
result of that decision is a fact of its own, which no best config holds: the winner and
its config, its time, the runner-up and the fastest extern implementation with theirs
(the margins), everything that was timed, when, and under which software.

0005 adds ``ft_choices``, one row per (device, op, problem key), replaced by each new
decision. Implementations are stored by name and source hash rather than as
``ft_templates`` rows: an extern implementation has no studies, and a decision is kept
when the studies behind it are not. Nothing existing changes; downgrading drops the
table and the decisions in it.

Revision ID: 0005
Revises: 0004
Create Date: 2027-01-10 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ_DATETIME = sa.DateTime(timezone=True)
VERSIONS = ("flashtune_version", "torch_version", "triton_version", "cuda_version",
            "driver_version")  # as ft_best_configs has them since 0004


def upgrade() -> None:
    op.create_table(
        "ft_choices",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("device_id", sa.Integer(), sa.ForeignKey("ft_devices.id"), nullable=False),
        sa.Column("op", sa.String(16), nullable=False),
        sa.Column("key_json", sa.Text(), nullable=False),
        sa.Column("bucket", sa.String(200), nullable=False),
        sa.Column("implementation", sa.String(200), nullable=False),
        sa.Column("source_hash", sa.String(64), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("median_ms", sa.Float(), nullable=False),
        sa.Column("tflops", sa.Float(), nullable=True),
        sa.Column("runner_up", sa.String(200), nullable=True),
        sa.Column("runner_up_ms", sa.Float(), nullable=True),
        sa.Column("extern", sa.String(200), nullable=True),
        sa.Column("extern_ms", sa.Float(), nullable=True),
        sa.Column("candidates_json", sa.Text(), nullable=False, server_default="[]"),
        sa.Column("decided_at", TZ_DATETIME, nullable=False),
        *(sa.Column(name, sa.String(200), nullable=False, server_default="")
          for name in VERSIONS),
        sa.UniqueConstraint("device_id", "op", "key_json", name="uq_ft_choices_device_op_key"),
    )
    op.create_index("ix_ft_choices_bucket", "ft_choices", ["bucket"])


def downgrade() -> None:
    op.drop_index("ix_ft_choices_bucket", table_name="ft_choices")
    op.drop_table("ft_choices")
