"""Database tables. Schema changes go through Alembic migrations in backend/migrations/."""
from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Integer, PrimaryKeyConstraint,
                        String, Text, TypeDecorator, UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

RUN_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled", "diverged")
FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "diverged"})
# The recipe a new experiment always trains and compares every other recipe with; code that compares reads the
# experiment's own `baseline`.
BASELINE_RECIPE = "bf16"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    type_annotation_map = {dict: JSON, list: JSON}


class Experiment(Base):
    __tablename__ = "experiments"
    __table_args__ = {"sqlite_autoincrement": True}  # ids never reused (migration 0008)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    description: Mapped[str] = mapped_column(Text, default="")
    model_config_: Mapped[dict] = mapped_column("model_config", JSON)
    data_config: Mapped[dict] = mapped_column(JSON)
    training_config: Mapped[dict] = mapped_column(JSON)
    seed: Mapped[int] = mapped_column(Integer, default=0)
    recipes: Mapped[list] = mapped_column(JSON)
    baseline: Mapped[str] = mapped_column(String(32), default=BASELINE_RECIPE)
    eval_tasks: Mapped[list] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Housekeeping (the user's own words about it): free tags, notes, and archiving (hidden from lists by default).
    tags: Mapped[list] = mapped_column(JSON, default=list)
    notes: Mapped[str] = mapped_column(Text, default="")
    archived_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True, index=True)

    runs: Mapped[list[Run]] = relationship(back_populates="experiment", order_by="Run.id",
                                           cascade="all, delete-orphan")

    # The verdict's stated tolerance is kept in training_config under VERDICT_KEY (a setting of the comparison,
    # not of any run; a column of its own would need a migration). `training_spec` is the training section
    # without it, as the runs' specs have it.
    VERDICT_KEY = "verdict"

    @property
    def training_spec(self) -> dict:
        return {k: v for k, v in (self.training_config or {}).items() if k != self.VERDICT_KEY}

    @property
    def verdict_tolerance_pct(self) -> float:
        from training.evaluation.verdict import DEFAULT_TOLERANCE_PCT

        return float(((self.training_config or {}).get(self.VERDICT_KEY) or {}).get("tolerance_pct",
                                                                                   DEFAULT_TOLERANCE_PCT))


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = {"sqlite_autoincrement": True}  # ids never reused (migration 0008)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment_id: Mapped[int] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"), index=True)
    recipe: Mapped[str] = mapped_column(String(32), index=True)
    recipe_options: Mapped[dict] = mapped_column(JSON, default=dict)
    bf16_first_layers: Mapped[int] = mapped_column(Integer, default=0)
    bf16_last_layers: Mapped[int] = mapped_column(Integer, default=0)
    label: Mapped[str] = mapped_column(String(200), default="")
    spec: Mapped[dict] = mapped_column(JSON)
    external: Mapped[bool] = mapped_column(Boolean, default=False)
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    worker_host: Mapped[str | None] = mapped_column(String(200), nullable=True)
    device_name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    gemm_backend: Mapped[str | None] = mapped_column(String(16), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    diverged_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    progress: Mapped[dict] = mapped_column(JSON, default=dict)
    summary: Mapped[dict] = mapped_column(JSON, default=dict)
    conversion_report: Mapped[dict] = mapped_column(JSON, default=dict)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # The lease of a running job (its last heartbeat) and the broker message of a queued one: what the reconciler
    # (backend/services/reconcile.py) reads to find runs whose worker died or whose message was lost.
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    dispatch_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    tags: Mapped[list] = mapped_column(JSON, default=list)
    notes: Mapped[str] = mapped_column(Text, default="")
    archived_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True, index=True)

    experiment: Mapped[Experiment] = relationship(back_populates="runs")

    @property
    def seed(self) -> int | None:
        """The seed the run trains with (its spec's; seed replicates of a recipe differ only in it)."""
        seed = (self.spec or {}).get("seed")
        return seed if isinstance(seed, int) else None


class MetricPoint(Base):
    """One point of a series, keyed (run_id, key, step).

    No foreign key to `runs`: its per-row check was a fifth of a metric batch's insert on PostgreSQL. Locks keep
    the rule instead (migration 0007): ingest holds the run row FOR NO KEY UPDATE for its transaction
    (`services.runs.ingest_metrics`, 404 when the run is gone) and deletion takes it FOR UPDATE before deleting
    the run's points (`services.housekeeping`), so no point is stored for a deleted run. Whatever deletes a run
    deletes its points itself."""
    __tablename__ = "metric_points"
    __table_args__ = (PrimaryKeyConstraint("run_id", "key", "step", name="metric_points_pkey"),)

    run_id: Mapped[int] = mapped_column(Integer, autoincrement=False)
    key: Mapped[str] = mapped_column(String(200))
    step: Mapped[int] = mapped_column(BigInteger, autoincrement=False)
    tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    wall_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    # NULL stands for a non-finite value (NaN/Inf), or one beyond +-1e300 (schemas.MAX_METRIC_MAGNITUDE, whose sums
    # overflow): SQLite cannot store NaN and JSON has no spelling for either.
    value: Mapped[float | None] = mapped_column(Float, nullable=True)


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = {"sqlite_autoincrement": True}  # ids never reused (migration 0008)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    path: Mapped[str] = mapped_column(Text)
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    meta: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class DocumentLimit(TypeDecorator):
    """An evaluation's `limit`: documents per task (a whole number) or a fraction of each task's documents in (0, 1),
    as lm-eval's --limit. Stored as a float (migration 0014; an integer before); read back as an int when whole, so a
    limit of 5 stays 5."""
    impl = Float
    cache_ok = True

    def process_result_value(self, value, dialect):
        return int(value) if value is not None and float(value).is_integer() else value


class Evaluation(Base):
    """One lm-eval job on one run's checkpoint."""
    __tablename__ = "evaluations"
    __table_args__ = {"sqlite_autoincrement": True}  # ids never reused (migration 0008)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    tasks: Mapped[list] = mapped_column(JSON)
    limit: Mapped[int | float | None] = mapped_column(DocumentLimit, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    lm_eval_version: Mapped[str | None] = mapped_column(String(32), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # the running job's lease (renewed by POST /evaluations/{id}/heartbeat; the reconciler ends a stale one) and the
    # queued job's message (the reconciler sends one the broker lost again), as a run's
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # the job that claimed it (its `running` report: host, message and attempt; backend.services.leases)
    worker_host: Mapped[str | None] = mapped_column(String(200), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # `running` reports (starts)
    dispatch_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class EvalResult(Base):
    __tablename__ = "eval_results"
    __table_args__ = (UniqueConstraint("evaluation_id", "task", name="uq_eval_task"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    evaluation_id: Mapped[int] = mapped_column(ForeignKey("evaluations.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    task: Mapped[str] = mapped_column(String(200))
    metrics: Mapped[dict] = mapped_column(JSON)
    samples: Mapped[dict] = mapped_column(JSON, default=dict)
    task_hash: Mapped[str | None] = mapped_column(String(128), nullable=True)
    duration_s: Mapped[float | None] = mapped_column(Float, nullable=True)


class GemmBenchmark(Base):
    __tablename__ = "gemm_benchmarks"
    __table_args__ = {"sqlite_autoincrement": True}  # ids never reused (migration 0008)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment_id: Mapped[int | None] = mapped_column(ForeignKey("experiments.id", ondelete="SET NULL"),
                                                      nullable=True, index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    request: Mapped[dict] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    device_name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    result: Mapped[dict] = mapped_column(JSON, default=dict)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the running job's lease (POST /gemm-benchmarks/{id}/heartbeat; the reconciler fails a stale one), and the queued
    # job's message and worker queue (the reconciler sends one the broker lost again, to the same queue)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # the job that claimed it (its `running` report: host, message and attempt; backend.services.leases)
    worker_host: Mapped[str | None] = mapped_column(String(200), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # `running` reports (starts)
    dispatch_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    queue: Mapped[str | None] = mapped_column(String(64), nullable=True)



class MetricRollup(Base):
    """Pre-computed min/max buckets of one metric series, maintained by `services.metrics.ingest`.

    Level `l` cuts the step axis into fixed buckets of 2**l steps (`bucket = step >> l`), so a bucket's content
    never depends on how long the run is yet: a new batch only merges into the buckets it touches. Each bucket
    keeps the minimum and the maximum point (a one-step spike survives every level) and the first point with a
    non-finite value (stored as NULL), plus sums for bucket means (the relative loss difference uses them).
    """
    __tablename__ = "metric_rollups"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    n_points: Mapped[int] = mapped_column(BigInteger)
    n_value: Mapped[int] = mapped_column(BigInteger)
    sum_value: Mapped[float] = mapped_column(Float)
    sum_step: Mapped[float] = mapped_column(Float)
    n_tokens: Mapped[int] = mapped_column(BigInteger)
    sum_tokens: Mapped[float] = mapped_column(Float)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    min_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    min_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    min_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    min_wall_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_wall_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    null_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    null_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    null_wall_time: Mapped[float | None] = mapped_column(Float, nullable=True)


class ApiToken(Base):
    """A scoped API token (backend/auth.py): only its SHA-256 is kept; `prefix` is what lists show."""
    __tablename__ = "api_tokens"
    __table_args__ = {"sqlite_autoincrement": True}  # ids never reused (migration 0008)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    scope: Mapped[str] = mapped_column(String(8))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Worker(Base):
    """A worker as it last described itself (`plab worker` registers every PLAB_WORKER_BEAT_S): the API checks
    a run's GPU and node needs against the live workers of its queue."""
    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    queues: Mapped[list] = mapped_column(JSON)
    slots: Mapped[int] = mapped_column(Integer)
    gpus_per_slot: Mapped[int] = mapped_column(Integer)     # 0: CPU slots (one process per job)
    launcher: Mapped[str] = mapped_column(String(16))       # local | slurm
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))
