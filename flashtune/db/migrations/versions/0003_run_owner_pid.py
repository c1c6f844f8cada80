"""The process id of each run, so a resumed job can tell a dead run from a live one.

A tuning job killed with ``kill -9`` (or by the OOM killer) leaves its run and its current
trial RUNNING. 0002 knew only the run's host and start time, so a resumed job had to wait
until a RUNNING trial was older than any trial could take before failing it. With the
owner's pid beside the host, a run of this host whose process is gone is dead at once.

Existing rows keep a NULL pid (their owner is unknown; they age out as before).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("ft_runs") as batch:
        batch.add_column(sa.Column("pid", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ft_runs") as batch:
        batch.drop_column("pid")
