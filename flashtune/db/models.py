"""SQLAlchemy 2.0 models of the tuning database (schema at ``HEAD_REVISION``).

Every table is prefixed ``ft_`` so Optuna's tables can live in the same database. JSON is
stored as canonical JSON ``TEXT`` (portable across SQLite and PostgreSQL; see
:mod:`flashtune.db.jsonutil`). Timestamps are timezone-aware UTC in Python; SQLite keeps
them as naive UTC text, PostgreSQL as ``timestamptz``.

These classes are the head of the migration history in ``flashtune/db/migrations``; a
change here needs a new revision there (tests compare the two).
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    BigInteger,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = ["Base", "BestConfig", "Choice", "Device", "Problem", "Run", "Template", "Trial",
           "utcnow"]

VERSION_LENGTH = 200  # a best config's version strings: as long as a config file's may be
OP_LENGTH = 16  # a user op's name (flashtune.core.spec.USER_OPS: "fwd", "decode")


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out, whatever the backend keeps."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware UTC datetime")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    """Declarative base of flashtune's tables (metadata used by the migrations' env.py)."""

    type_annotation_map = {datetime: UTCDateTime()}


class Device(Base):
    __tablename__ = "ft_devices"
    __table_args__ = (
        UniqueConstraint("name", "compute_capability", "sm_count", "shared_mem_per_block",
                         "total_memory", name="uq_ft_devices_hardware"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    compute_capability: Mapped[str] = mapped_column(String(32))
    sm_count: Mapped[int] = mapped_column(Integer)
    shared_mem_per_block: Mapped[int] = mapped_column(BigInteger)
    total_memory: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Template(Base):
    __tablename__ = "ft_templates"
    __table_args__ = (
        UniqueConstraint("name", "source_hash", name="uq_ft_templates_name_source_hash"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    source_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Problem(Base):
    __tablename__ = "ft_problems"
    __table_args__ = (
        UniqueConstraint("template_name", "key_json", name="uq_ft_problems_template_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    template_name: Mapped[str] = mapped_column(String(200))
    key_json: Mapped[str] = mapped_column(Text)  # canonical JSON of the problem key
    bucket: Mapped[str] = mapped_column(String(200), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Run(Base):
    __tablename__ = "ft_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("ft_devices.id"))
    template_id: Mapped[int] = mapped_column(ForeignKey("ft_templates.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("ft_problems.id"))
    study_name: Mapped[str] = mapped_column(String(300))
    sampler: Mapped[str] = mapped_column(String(100))
    seed: Mapped[int | None] = mapped_column(Integer)
    params_json: Mapped[str] = mapped_column(Text, default="{}")
    status: Mapped[str] = mapped_column(String(32), index=True)  # index since 0002
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    flashtune_version: Mapped[str] = mapped_column(String(64), default="")
    torch_version: Mapped[str] = mapped_column(String(64), default="")
    triton_version: Mapped[str] = mapped_column(String(64), default="")
    cuda_version: Mapped[str] = mapped_column(String(64), default="")
    driver_version: Mapped[str] = mapped_column(String(64), default="",
                                                server_default="")  # since 0002
    host: Mapped[str] = mapped_column(String(255), default="", server_default="")  # since 0002
    pid: Mapped[int | None] = mapped_column(Integer)  # owner process on ``host``; since 0003


class Trial(Base):
    __tablename__ = "ft_trials"
    __table_args__ = (
        UniqueConstraint("run_id", "number", name="uq_ft_trials_run_number"),
        # numbers count within the study, so concurrent runs of one study cannot collide
        UniqueConstraint("device_id", "template_id", "problem_id", "number",
                         name="uq_ft_trials_study_number"),
        Index("ix_ft_trials_study_config", "device_id", "template_id", "problem_id",
              "config_hash"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("ft_runs.id"))
    device_id: Mapped[int] = mapped_column(ForeignKey("ft_devices.id"))
    template_id: Mapped[int] = mapped_column(ForeignKey("ft_templates.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("ft_problems.id"))
    number: Mapped[int] = mapped_column(Integer)
    config_json: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(32))
    message: Mapped[str | None] = mapped_column(Text)
    median_ms: Mapped[float | None] = mapped_column(Float)
    p20_ms: Mapped[float | None] = mapped_column(Float)  # since 0002
    p80_ms: Mapped[float | None] = mapped_column(Float)  # since 0002
    tflops: Mapped[float | None] = mapped_column(Float)
    compile_s: Mapped[float | None] = mapped_column(Float)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]


class BestConfig(Base):
    __tablename__ = "ft_best_configs"
    __table_args__ = (
        UniqueConstraint("device_id", "template_id", "problem_id", name="uq_ft_best_configs_study"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("ft_devices.id"))
    template_id: Mapped[int] = mapped_column(ForeignKey("ft_templates.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("ft_problems.id"))
    config_json: Mapped[str] = mapped_column(Text)
    median_ms: Mapped[float] = mapped_column(Float)
    tflops: Mapped[float | None] = mapped_column(Float)
    trial_id: Mapped[int | None] = mapped_column(ForeignKey("ft_trials.id", ondelete="SET NULL"))
    trials_count: Mapped[int] = mapped_column(Integer, default=0)
    tuned_at: Mapped[datetime]
    # the software it was tuned under (its trial's run's, or an imported file's); since 0004
    flashtune_version: Mapped[str] = mapped_column(String(VERSION_LENGTH), default="",
                                                   server_default="")
    torch_version: Mapped[str] = mapped_column(String(VERSION_LENGTH), default="",
                                               server_default="")
    triton_version: Mapped[str] = mapped_column(String(VERSION_LENGTH), default="",
                                                server_default="")
    cuda_version: Mapped[str] = mapped_column(String(VERSION_LENGTH), default="",
                                              server_default="")
    driver_version: Mapped[str] = mapped_column(String(VERSION_LENGTH), default="",
                                                server_default="")


class Choice(Base):
    """The tuner's cross-implementation decision for one user op and problem on one device:
    which implementation (and config) won, by how much, and what else was timed; since 0005.

    Implementations are named, not joined to ``ft_templates``: an extern implementation
    (torch SDPA's backends) has no trials of its own, and a decision outlives the rows of
    the studies that led to it. ``source_hash`` is the winner's when it was decided.
    """

    __tablename__ = "ft_choices"
    __table_args__ = (
        UniqueConstraint("device_id", "op", "key_json", name="uq_ft_choices_device_op_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("ft_devices.id"))
    op: Mapped[str] = mapped_column(String(OP_LENGTH))
    key_json: Mapped[str] = mapped_column(Text)  # canonical JSON of the problem key
    bucket: Mapped[str] = mapped_column(String(200), index=True)
    implementation: Mapped[str] = mapped_column(String(200))
    source_hash: Mapped[str] = mapped_column(String(64))
    config_json: Mapped[str] = mapped_column(Text)
    median_ms: Mapped[float] = mapped_column(Float)
    tflops: Mapped[float | None] = mapped_column(Float)
    runner_up: Mapped[str | None] = mapped_column(String(200))
    runner_up_ms: Mapped[float | None] = mapped_column(Float)
    # the fastest extern implementation timed beside the winner (may be the winner)
    extern: Mapped[str | None] = mapped_column(String(200))
    extern_ms: Mapped[float | None] = mapped_column(Float)
    # canonical JSON list of {implementation, config, median_ms}: everything timed
    candidates_json: Mapped[str] = mapped_column(Text, default="[]", server_default="[]")
    decided_at: Mapped[datetime]
    flashtune_version: Mapped[str] = mapped_column(String(VERSION_LENGTH), default="",
                                                   server_default="")
    torch_version: Mapped[str] = mapped_column(String(VERSION_LENGTH), default="",
                                               server_default="")
    triton_version: Mapped[str] = mapped_column(String(VERSION_LENGTH), default="",
                                                server_default="")
    cuda_version: Mapped[str] = mapped_column(String(VERSION_LENGTH), default="",
                                              server_default="")
    driver_version: Mapped[str] = mapped_column(String(VERSION_LENGTH), default="",
                                                server_default="")


FT_TABLES: tuple[str, ...] = tuple(Base.metadata.tables)
