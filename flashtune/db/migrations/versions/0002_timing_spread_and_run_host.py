"""Timing spread per trial, host and driver per run, index on run status.

0001 kept only the median of each trial, which hid noisy measurements; 0002 keeps the
20th/80th percentiles next to it. Runs gain the host name and the driver version, so a
result can be traced to the machine and driver it was measured under (driver updates
change kernel timings). ``fail_stale_runs`` looks runs up by status: index it.

Existing rows keep NULL percentiles (they were never measured) and empty host/driver.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-14 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("ft_trials") as batch:
        batch.add_column(sa.Column("p20_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("p80_ms", sa.Float(), nullable=True))
    with op.batch_alter_table("ft_runs") as batch:
        batch.add_column(sa.Column("driver_version", sa.String(64), nullable=False,
                                   server_default=""))
        batch.add_column(sa.Column("host", sa.String(255), nullable=False, server_default=""))
    op.create_index("ix_ft_runs_status", "ft_runs", ["status"])


def downgrade() -> None:
    op.drop_index("ix_ft_runs_status", table_name="ft_runs")
    with op.batch_alter_table("ft_runs") as batch:
        batch.drop_column("host")
        batch.drop_column("driver_version")
    with op.batch_alter_table("ft_trials") as batch:
        batch.drop_column("p80_ms")
        batch.drop_column("p20_ms")
