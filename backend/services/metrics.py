"""Metric ingest (idempotent on run+key+step) and min/max-preserving downsampling."""
from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from backend.models import MetricPoint
from backend.schemas import MetricPointIn, Series

_X_COLUMNS = {"step": "step", "tokens": "tokens", "wall_time": "wall_time"}
# SQLite allows at most 32766 bound variables per statement; 6 columns a row.
_SQLITE_CHUNK = 5000


def ingest(session: Session, run_id: int, points: Sequence[MetricPointIn]) -> tuple[int, int]:
    """Insert points, ignoring (run, key, step) already stored. Returns (inserted, duplicates).

    A retried batch therefore never duplicates, and the first value written for a step wins: a resumed run
    re-sending a step it already reported cannot rewrite history.
    """
    if not points:
        return 0, 0
    # Collapse duplicates inside the batch itself (first wins), so the count is honest.
    unique: dict[tuple[str, int], MetricPointIn] = {}
    for p in points:
        unique.setdefault((p.key, p.step), p)
    rows = [dict(run_id=run_id, key=p.key, step=p.step, value=p.value, tokens=p.tokens, wall_time=p.wall_time)
            for p in unique.values()]
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    inserted = 0
    chunk = _SQLITE_CHUNK if dialect == "sqlite" else 10_000
    for i in range(0, len(rows), chunk):
        # RETURNING counts what was really inserted (rowcount is -1 for multi-row inserts on some drivers).
        stmt = insert(MetricPoint).values(rows[i:i + chunk]).on_conflict_do_nothing(
            index_elements=["run_id", "key", "step"]).returning(MetricPoint.id)
        inserted += len(session.execute(stmt).all())
    return inserted, len(points) - inserted


def metric_keys(session: Session, run_id: int) -> list[dict]:
    rows = session.execute(
        select(MetricPoint.key, func.count(), func.max(MetricPoint.step))
        .where(MetricPoint.run_id == run_id).group_by(MetricPoint.key).order_by(MetricPoint.key)).all()
    return [{"key": k, "points": n, "last_step": s} for k, n, s in rows]


def read_series(session: Session, run_id: int, key: str, *, max_points: int = 2000, x: str = "step",
                x_min: float | None = None, x_max: float | None = None) -> Series:
    """A series, downsampled on the server when longer than max_points.

    Buckets are equal ranges of steps; each keeps its minimum and its maximum point (and every non-finite point),
    so a one-step loss spike survives any zoom level, and at most max_points points come back.
    """
    xcol = _X_COLUMNS[x]
    where = "run_id = :run_id AND key = :key"
    params: dict = {"run_id": run_id, "key": key}
    if x_min is not None:
        where += f" AND {xcol} >= :x_min"
        params["x_min"] = x_min
    if x_max is not None:
        where += f" AND {xcol} <= :x_max"
        params["x_max"] = x_max
    n, lo, hi = session.execute(
        text(f"SELECT COUNT(*), MIN(step), MAX(step) FROM metric_points WHERE {where}"), params).one()
    if n <= max_points:
        rows = session.execute(text(
            f"SELECT step, tokens, wall_time, value FROM metric_points WHERE {where} ORDER BY step"), params).all()
        downsampled = False
    else:
        buckets = max(1, max_points // 2)
        span = hi - lo + 1
        rows = session.execute(text(f"""
            SELECT step, tokens, wall_time, value FROM (
              SELECT step, tokens, wall_time, value,
                ROW_NUMBER() OVER (PARTITION BY b ORDER BY CASE WHEN value IS NULL THEN 1 ELSE 0 END, value, step)
                  AS rmin,
                ROW_NUMBER() OVER (PARTITION BY b ORDER BY CASE WHEN value IS NULL THEN 1 ELSE 0 END,
                                   value DESC, step) AS rmax
              FROM (SELECT step, tokens, wall_time, value, ((step - :lo) * :buckets) / :span AS b
                    FROM metric_points WHERE {where}) AS t
            ) AS u
            WHERE rmin = 1 OR rmax = 1 OR value IS NULL
            ORDER BY step"""), {**params, "lo": lo, "buckets": buckets, "span": span}).all()
        downsampled = True
    return Series(key=key, step=[r[0] for r in rows], tokens=[r[1] for r in rows],
                  wall_time=[r[2] for r in rows], value=[r[3] for r in rows], total_points=n,
                  downsampled=downsampled)
