"""The software each best config was tuned under, kept on the best config itself.

Until 0003 a best config knew its software only through its trial's run, and an imported
one (no trial, no run) not at all: ``flashtune export`` wrote the versions of the latest
run of the device and template for every entry, and a config that came from a file came
back with empty versions. 0004 gives each best config the flashtune, torch, Triton, CUDA
and driver versions it was tuned under (up to 200 characters, as a config file's software
strings), written when the tuner records it and when a file is imported.

Existing rows take the versions of their trial's run; rows without a trial (imported from
a file, or whose trial is gone) keep empty ones: their software was never recorded.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("flashtune_version", "torch_version", "triton_version", "cuda_version",
           "driver_version")  # the same names in ft_runs and ft_best_configs


def upgrade() -> None:
    with op.batch_alter_table("ft_best_configs") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.String(200), nullable=False,
                                       server_default=""))
    best = sa.table("ft_best_configs", sa.column("trial_id", sa.Integer()),
                    *(sa.column(name, sa.String()) for name in COLUMNS))
    trials = sa.table("ft_trials", sa.column("id", sa.Integer()),
                      sa.column("run_id", sa.Integer()))
    runs = sa.table("ft_runs", sa.column("id", sa.Integer()),
                    *(sa.column(name, sa.String()) for name in COLUMNS))

    def of_run(name: str) -> sa.ScalarSelect[str]:  # the best config's trial's run's
        return (sa.select(runs.c[name])
                .select_from(runs.join(trials, trials.c.run_id == runs.c.id))
                .where(trials.c.id == best.c.trial_id).scalar_subquery())

    op.execute(best.update().where(best.c.trial_id.is_not(None))
               .values({name: sa.func.coalesce(of_run(name), "") for name in COLUMNS}))


def downgrade() -> None:
    with op.batch_alter_table("ft_best_configs") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)
