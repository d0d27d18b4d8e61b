"""Metric ingest (idempotent on run+key+step) and min/max-preserving downsampling from a rollup.

Reading a long series by scanning its raw rows costs tens of milliseconds per series on PostgreSQL however it
is written (bench/dashboard_bench.py measured it), so the dashboard reads pre-computed buckets instead:
`metric_rollups` holds, per (run, key), levels 4..24 of fixed power-of-two step buckets (`bucket = step >> level`).
Ingest merges each newly inserted point into its bucket at every level, in the same transaction as the raw
insert; only rows the raw insert really stored are merged, so a re-sent batch changes nothing.

A bucket keeps its minimum point, its maximum point (ties: the earliest step), its first point whose value is
non-finite (stored as NULL) and sums for bucket means. A one-step spike is the maximum of every bucket that
holds it, so it survives every level; a NULL point likewise.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from sqlalchemy import and_, bindparam, case, delete, func, or_, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from backend.errors import InvalidInput
from backend.models import MetricPoint, MetricRollup
from backend.schemas import MetricPointIn, Series

log = logging.getLogger(__name__)
_X_COLUMNS = {"step": "step", "tokens": "tokens", "wall_time": "wall_time"}
# Level 4 (16 steps) is the finest: ranges narrower than 16 * max_points / 2 steps are read raw (at most
# 8 * max_points rows). Level 24 (16.7 M steps) is the coarsest: coarser answers merge its rows in Python.
MIN_LEVEL = 4
MAX_LEVEL = 24
LEVELS = tuple(range(MIN_LEVEL, MAX_LEVEL + 1))


class Point(NamedTuple):
    step: int
    tokens: int | None
    wall_time: float | None
    value: float | None


class Agg:
    """One bucket's summary; the same arithmetic merges raw points (ingest, edges) and stored rollup rows."""
    __slots__ = ("n_points", "n_value", "sum_value", "sum_step", "n_tokens", "sum_tokens", "first_step",
                 "last_step", "min", "max", "null")

    def __init__(self, p: Point):
        self.n_points = 1
        self.first_step = self.last_step = p.step
        if p.value is None:
            self.n_value, self.sum_value, self.sum_step, self.n_tokens, self.sum_tokens = 0, 0.0, 0.0, 0, 0.0
            self.min = self.max = None
            self.null = p
        else:
            self.n_value, self.sum_value, self.sum_step = 1, p.value, float(p.step)
            self.n_tokens, self.sum_tokens = (0, 0.0) if p.tokens is None else (1, float(p.tokens))
            self.min = self.max = p
            self.null = None

    def add(self, o: Agg) -> None:
        self.n_points += o.n_points
        self.n_value += o.n_value
        self.sum_value += o.sum_value
        self.sum_step += o.sum_step
        self.n_tokens += o.n_tokens
        self.sum_tokens += o.sum_tokens
        self.first_step = min(self.first_step, o.first_step)
        self.last_step = max(self.last_step, o.last_step)
        if o.min is not None and (self.min is None or (o.min.value, o.min.step) < (self.min.value, self.min.step)):
            self.min = o.min
        if o.max is not None and (self.max is None or (-o.max.value, o.max.step) < (-self.max.value, self.max.step)):
            self.max = o.max
        if o.null is not None and (self.null is None or o.null.step < self.null.step):
            self.null = o.null

    def points(self) -> list[Point]:
        """What a downsampled answer shows for this bucket: min, max and first NULL point, by step."""
        pts = {p.step: p for p in (self.min, self.max, self.null) if p is not None}
        return [pts[s] for s in sorted(pts)]

    def row(self, run_id: int, key: str, level: int, bucket: int) -> dict:
        mn, mx, nl = self.min, self.max, self.null
        return dict(run_id=run_id, key=key, level=level, bucket=bucket, n_points=self.n_points,
                    n_value=self.n_value, sum_value=self.sum_value, sum_step=self.sum_step, n_tokens=self.n_tokens,
                    sum_tokens=self.sum_tokens, first_step=self.first_step, last_step=self.last_step,
                    min_value=mn and mn.value, min_step=mn and mn.step, min_tokens=mn and mn.tokens,
                    min_wall_time=mn and mn.wall_time,
                    max_value=mx and mx.value, max_step=mx and mx.step, max_tokens=mx and mx.tokens,
                    max_wall_time=mx and mx.wall_time,
                    null_step=nl and nl.step, null_tokens=nl and nl.tokens, null_wall_time=nl and nl.wall_time)

    @classmethod
    def from_row(cls, r) -> Agg:
        a = cls.__new__(cls)
        (a.n_points, a.n_value, a.sum_value, a.sum_step, a.n_tokens, a.sum_tokens, a.first_step,
         a.last_step) = r[1:9]
        a.min = None if r[9] is None else Point(r[10], r[11], r[12], r[9])
        a.max = None if r[13] is None else Point(r[14], r[15], r[16], r[13])
        a.null = None if r[17] is None else Point(r[17], r[18], r[19], None)
        return a


# The columns `Agg.from_row` reads, after the bucket number.
_ROLLUP_COLUMNS = ("bucket", "n_points", "n_value", "sum_value", "sum_step", "n_tokens", "sum_tokens", "first_step",
                   "last_step", "min_value", "min_step", "min_tokens", "min_wall_time", "max_value", "max_step",
                   "max_tokens", "max_wall_time", "null_step", "null_tokens", "null_wall_time")
_ROLLUP_SELECT = ", ".join(_ROLLUP_COLUMNS)


def bucketize(points: Iterable[Point], shift: int) -> dict[int, Agg]:
    """Raw points into buckets of 2**shift steps."""
    out: dict[int, Agg] = {}
    for p in points:
        b = p.step >> shift
        a = out.get(b)
        if a is None:
            out[b] = Agg(p)
        else:
            a.add(Agg(p))
    return out


def coarsen(buckets: dict[int, Agg], by: int) -> dict[int, Agg]:
    """Buckets of 2**l steps into buckets of 2**(l+by) steps (fixed buckets nest exactly)."""
    if by == 0:
        return buckets
    out: dict[int, Agg] = {}
    for b in sorted(buckets):
        nb = b >> by
        a = out.get(nb)
        if a is None:
            # A copy: merging must not mutate the finer level's bucket.
            a = out[nb] = Agg.__new__(Agg)
            src = buckets[b]
            for f in Agg.__slots__:
                setattr(a, f, getattr(src, f))
        else:
            a.add(buckets[b])
    return out


def rollup_levels(points: Iterable[Point]) -> dict[int, dict[int, Agg]]:
    """Every level's buckets for a set of points: level 4 from the points, each next level from the previous."""
    levels = {MIN_LEVEL: bucketize(points, MIN_LEVEL)}
    for lv in LEVELS[1:]:
        levels[lv] = coarsen(levels[lv - 1], 1)
    return levels


# ---------------------------------------------------------------------------------------------- writing
def _insert_fn(session: Session):
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert


def _merge_rollup(session: Session, rows: list[dict]) -> None:
    """Upsert bucket rows, merging into stored buckets with the same rules as `Agg.add`."""
    if not rows:
        return
    insert = _insert_fn(session)
    t = MetricRollup.__table__.c
    # One compiled statement executed over the rows (SQLAlchemy batches them into multi-row VALUES itself):
    # compiling a statement with the rows inlined costs more than the database's work.
    stmt = insert(MetricRollup.__table__)
    ex = stmt.excluded
    new_min = and_(ex.min_value.is_not(None), or_(
        t.min_value.is_(None), ex.min_value < t.min_value,
        and_(ex.min_value == t.min_value, ex.min_step < t.min_step)))
    new_max = and_(ex.max_value.is_not(None), or_(
        t.max_value.is_(None), ex.max_value > t.max_value,
        and_(ex.max_value == t.max_value, ex.max_step < t.max_step)))
    new_null = and_(ex.null_step.is_not(None), or_(t.null_step.is_(None), ex.null_step < t.null_step))
    set_ = {c: t[c] + ex[c] for c in ("n_points", "n_value", "sum_value", "sum_step", "n_tokens", "sum_tokens")}
    set_["first_step"] = case((ex.first_step < t.first_step, ex.first_step), else_=t.first_step)
    set_["last_step"] = case((ex.last_step > t.last_step, ex.last_step), else_=t.last_step)
    for prefix, cond in (("min", new_min), ("max", new_max)):
        for f in ("value", "step", "tokens", "wall_time"):
            c = f"{prefix}_{f}"
            set_[c] = case((cond, ex[c]), else_=t[c])
    for f in ("step", "tokens", "wall_time"):
        c = f"null_{f}"
        set_[c] = case((new_null, ex[c]), else_=t[c])
    session.connection().execute(
        stmt.on_conflict_do_update(index_elements=["run_id", "key", "level", "bucket"], set_=set_), rows)


def _rollup_rows(run_id: int, key: str, points: Iterable[Point]) -> list[dict]:
    return [a.row(run_id, key, lv, b) for lv, buckets in rollup_levels(points).items() for b, a in buckets.items()]


def ingest(session: Session, run_id: int, points: Sequence[MetricPointIn]) -> tuple[int, int]:
    """Insert points, ignoring (run, key, step) already stored, and merge the new ones into the rollup.
    Returns (inserted, duplicates).

    A retried batch therefore never duplicates (raw rows nor rollup counts), and the first value written for a
    step wins: a resumed run re-sending a step it already reported cannot rewrite history.
    """
    if not points:
        return 0, 0
    # Collapse duplicates inside the batch itself (first wins), so the count is honest.
    unique: dict[tuple[str, int], MetricPointIn] = {}
    for p in points:
        unique.setdefault((p.key, p.step), p)
    rows = [dict(run_id=run_id, key=p.key, step=p.step, value=p.value, tokens=p.tokens, wall_time=p.wall_time)
            for p in unique.values()]
    insert = _insert_fn(session)
    table = MetricPoint.__table__
    stored: dict[str, list[Point]] = {}
    # RETURNING names what was really inserted (rowcount is -1 for multi-row inserts on some drivers); only
    # those points enter the rollup. Executed over the rows, the statement compiles once and SQLAlchemy sends
    # it as multi-row VALUES batches within the driver's parameter limits.
    stmt = insert(table).on_conflict_do_nothing(index_elements=["run_id", "key", "step"]).returning(
        table.c.key, table.c.step)
    for key, step in session.connection().execute(stmt, rows).all():
        p = unique[(key, step)]
        stored.setdefault(key, []).append(Point(step, p.tokens, p.wall_time, p.value))
    for key, pts in stored.items():
        _merge_rollup(session, _rollup_rows(run_id, key, pts))
    inserted = sum(len(v) for v in stored.values())
    return inserted, len(points) - inserted


def rebuild_rollup(session: Session, run_id: int | None = None) -> int:
    """Recompute the rollup of one run (or of all runs) from the raw rows; returns the rows written.

    Ingest keeps the rollup current; this is for rows that arrived another way (the 0002 migration's backfill,
    a bulk COPY as in bench/dashboard_bench.py).
    """
    if run_id is not None and (not isinstance(run_id, int) or run_id < 1):
        raise InvalidInput(f"run_id must be a positive integer or None for every run, got {run_id!r}")
    where = "" if run_id is None else "WHERE run_id = :run_id"
    params = {} if run_id is None else {"run_id": run_id}
    session.execute(delete(MetricRollup).where(MetricRollup.run_id == run_id) if run_id is not None
                    else delete(MetricRollup))
    series = session.execute(text(f"SELECT DISTINCT run_id, key FROM metric_points {where}"), params).all()
    written = 0
    for rid, key in series:
        rows = session.execute(text("SELECT step, tokens, wall_time, value FROM metric_points "
                                    "WHERE run_id = :r AND key = :k ORDER BY step"), {"r": rid, "k": key})
        out = _rollup_rows(rid, key, (Point(*r) for r in rows))
        _merge_rollup(session, out)
        written += len(out)
    return written


def metric_keys(session: Session, run_id: int) -> list[dict]:
    rows = session.execute(
        select(MetricPoint.key, func.count(), func.max(MetricPoint.step))
        .where(MetricPoint.run_id == run_id).group_by(MetricPoint.key).order_by(MetricPoint.key)).all()
    return [{"key": k, "points": n, "last_step": s} for k, n, s in rows]


# ---------------------------------------------------------------------------------------------- reading
def _validate(max_points: int, x: str, x_min: float | None, x_max: float | None) -> None:
    if x not in _X_COLUMNS:
        raise InvalidInput(f"x must be one of {', '.join(_X_COLUMNS)}, got {x!r}")
    if not isinstance(max_points, int) or max_points < 4:
        raise InvalidInput(f"max_points must be an integer of at least 4 (a min and a max point for two buckets), "
                           f"got {max_points!r}")
    for name, v in (("x_min", x_min), ("x_max", x_max)):
        if v is not None and not math.isfinite(v):
            raise InvalidInput(f"{name} must be a finite number or left out, got {v!r}")
    if x_min is not None and x_max is not None and x_min > x_max:
        raise InvalidInput(f"x_min ({x_min}) must not exceed x_max ({x_max})")


def series_extent(session: Session, run_id: int, key: str) -> tuple[int, int, int] | None:
    """(first step, last step, number of points) of a series, from the rollup's coarsest level (a row or two)."""
    row = session.execute(text(
        "SELECT MIN(first_step), MAX(last_step), SUM(n_points) FROM metric_rollups "
        "WHERE run_id = :r AND key = :k AND level = :lv"), {"r": run_id, "k": key, "lv": MAX_LEVEL}).one()
    return None if row[0] is None else (int(row[0]), int(row[1]), int(row[2]))


def _raw(session: Session, run_id: int, key: str, lo: int, hi: int) -> list[Point]:
    rows = session.execute(text(
        "SELECT step, tokens, wall_time, value FROM metric_points "
        "WHERE run_id = :r AND key = :k AND step >= :lo AND step <= :hi ORDER BY step"),
        {"r": run_id, "k": key, "lo": lo, "hi": hi}).all()
    return [Point(*r) for r in rows]


def read_buckets(session: Session, run_id: int, key: str, lo: int, hi: int, shift: int) -> dict[int, Agg]:
    """The buckets of 2**shift steps covering steps lo..hi, holding exactly the points with lo <= step <= hi.

    Reads the rollup at min(shift, 24) and merges coarser in Python; a bucket cut by lo or hi is recomputed
    from its raw rows (at most two buckets' worth), and shifts under level 4 read raw rows.
    """
    if shift < MIN_LEVEL:
        return bucketize(_raw(session, run_id, key, lo, hi), shift)
    lv = min(shift, MAX_LEVEL)
    rows = session.execute(text(
        f"SELECT {_ROLLUP_SELECT} FROM metric_rollups WHERE run_id = :r AND key = :k AND level = :lv "
        "AND bucket >= :b0 AND bucket <= :b1 ORDER BY bucket"),
        {"r": run_id, "k": key, "lv": lv, "b0": lo >> lv, "b1": hi >> lv}).all()
    buckets = {r[0]: Agg.from_row(r) for r in rows}
    for b in {lo >> lv, hi >> lv}:
        a = buckets.get(b)
        if a is not None and (a.first_step < lo or a.last_step > hi):
            start, end = max(lo, b << lv), min(hi, ((b + 1) << lv) - 1)
            part = bucketize(_raw(session, run_id, key, start, end), lv)
            if part:
                buckets[b] = part[b]
            else:
                del buckets[b]
    return coarsen(buckets, shift - lv)


def _shift_for(lo: int, hi: int, n_buckets: int) -> int:
    """The finest power-of-two bucket width giving at most n_buckets buckets over lo..hi."""
    k = 0
    while (hi >> k) - (lo >> k) + 1 > n_buckets:
        k += 1
    return k


def step_range(session: Session, run_id: int, key: str, x: str, x_min: float | None, x_max: float | None,
               extent: tuple[int, int, int]) -> tuple[int, int] | None:
    """The steps lo..hi of the series' points inside the x range, or None when none is there."""
    first, last, _ = extent
    if x == "step" or (x_min is None and x_max is None):
        lo = first if x_min is None else max(first, math.ceil(x_min))
        hi = last if x_max is None else min(last, math.floor(x_max))
        return (lo, hi) if lo <= hi else None
    # tokens and wall time grow with the step; the points inside the range therefore span lo..hi. This scans
    # the series' raw rows (only zoomed token/time queries pay it).
    xcol = _X_COLUMNS[x]
    where, params = "run_id = :r AND key = :k", {"r": run_id, "k": key}
    if x_min is not None:
        where += f" AND {xcol} >= :x_min"
        params["x_min"] = x_min
    if x_max is not None:
        where += f" AND {xcol} <= :x_max"
        params["x_max"] = x_max
    lo, hi = session.execute(text(f"SELECT MIN(step), MAX(step) FROM metric_points WHERE {where}"), params).one()
    return None if lo is None else (int(lo), int(hi))


def read_series(session: Session, run_id: int, key: str, *, max_points: int = 2000, x: str = "step",
                x_min: float | None = None, x_max: float | None = None) -> Series:
    """A series, downsampled on the server when longer than max_points.

    The answer comes from the rollup: the finest power-of-two bucket width that gives at most max_points / 2
    buckets over the requested range; each bucket contributes its min point, its max point and its first NULL
    point, in step order, so a one-step spike (or a non-finite value) is visible at any zoom and at most
    max_points points come back. When the range holds at most max_points points they all come back, raw.
    An unknown key is an empty series.
    """
    _validate(max_points, x, x_min, x_max)
    empty = Series(key=key, step=[], tokens=[], wall_time=[], value=[], total_points=0, downsampled=False)
    extent = series_extent(session, run_id, key)
    if extent is None:
        # ORDER BY step keeps PostgreSQL on the (run, key, step) index: with a bare LIMIT 1 it may pick a
        # sequential scan, which reads the whole table when the key is absent (measured: 70 ms a series).
        if session.execute(text("SELECT step FROM metric_points WHERE run_id = :r AND key = :k "
                                "ORDER BY step LIMIT 1"), {"r": run_id, "k": key}).first() is not None:
            return _read_without_rollup(session, run_id, key, max_points, x, x_min, x_max)
        return empty
    rng = step_range(session, run_id, key, x, x_min, x_max, extent)
    if rng is None:
        return empty
    lo, hi = rng
    if hi - lo + 1 <= max_points:  # steps are unique, so the range holds at most this many points
        return _as_series(key, _raw(session, run_id, key, lo, hi), downsampled=False)
    shift = _shift_for(lo, hi, max_points // 2)
    whole = (lo, hi) == extent[:2]
    if whole and extent[2] <= max_points:
        return _as_series(key, _raw(session, run_id, key, lo, hi), downsampled=False)
    if whole and MIN_LEVEL <= shift <= MAX_LEVEL:
        # The common case (a whole series): stored buckets are the answer's buckets, no edge to cut.
        pts = _bucket_points(session, run_id, key, shift, max_points)
        if pts is not None:
            return _as_series(key, pts, downsampled=True, total=extent[2])
    buckets = read_buckets(session, run_id, key, lo, hi, shift)
    total = sum(a.n_points for a in buckets.values())
    if total <= max_points:
        return _as_series(key, _raw(session, run_id, key, lo, hi), downsampled=False)
    while True:
        pts = [p for b in sorted(buckets) for p in buckets[b].points()]
        # NULL points can make a bucket show three points; one width coarser halves the buckets.
        if len(pts) <= max_points:
            return _as_series(key, pts, downsampled=True, total=total)
        buckets = coarsen(buckets, 1)


_POINT_COLUMNS = ("min_step, min_tokens, min_wall_time, min_value, max_step, max_tokens, max_wall_time, max_value, "
                  "null_step, null_tokens, null_wall_time")


def _bucket_points(session: Session, run_id: int, key: str, level: int, max_points: int) -> list[Point] | None:
    """The min, max and first-NULL points of every stored bucket of a level, in step order; None when they
    exceed max_points."""
    rows = session.execute(text(
        f"SELECT {_POINT_COLUMNS} FROM metric_rollups "
        "WHERE run_id = :r AND key = :k AND level = :lv ORDER BY bucket"),
        {"r": run_id, "k": key, "lv": level}).all()
    return _emit(rows, max_points)


def _emit(rows, max_points: int) -> list[Point] | None:
    # Straight from the rows, no per-bucket objects: this loop is most of the series endpoint's own time.
    pts: list = []
    add = pts.append
    for ms, mt, mw, mv, xs, xt, xw, xv, ns, nt, nw in rows:
        if ns is None:
            if ms == xs:
                add((ms, mt, mw, mv))
            elif ms < xs:
                add((ms, mt, mw, mv))
                add((xs, xt, xw, xv))
            else:
                add((xs, xt, xw, xv))
                add((ms, mt, mw, mv))
        else:
            group = {ns: (ns, nt, nw, None)}
            if mv is not None:
                group[ms] = (ms, mt, mw, mv)
                group[xs] = (xs, xt, xw, xv)
            pts.extend(group[s] for s in sorted(group))
    return pts if len(pts) <= max_points else None


def read_many(session: Session, run_ids: Sequence[int], keys: Sequence[str], *, max_points: int = 2000,
              x: str = "step", x_min: float | None = None, x_max: float | None = None) -> dict[tuple[int, str], Series]:
    """`read_series` for every (run, key) pair, the same answers; whole long series (the dashboard's first
    view) are read in two queries (per 64 series) instead of two per series: round trips dominate on a loaded
    database host."""
    _validate(max_points, x, x_min, x_max)
    pairs = [(r, k) for r in run_ids for k in keys]
    out: dict[tuple[int, str], Series] = {}
    batch: dict[tuple[int, str], tuple[int, int]] = {}  # pair -> (level, total points)
    if x_min is None and x_max is None and pairs:
        ext = session.execute(
            text("SELECT run_id, key, MIN(first_step), MAX(last_step), SUM(n_points) FROM metric_rollups "
                 "WHERE run_id IN :runs AND key IN :keys AND level = :lv GROUP BY run_id, key")
            .bindparams(bindparam("runs", expanding=True), bindparam("keys", expanding=True)),
            {"runs": list(set(run_ids)), "keys": list(set(keys)), "lv": MAX_LEVEL}).all()
        for r, k, first, last, total in ext:
            shift = _shift_for(int(first), int(last), max_points // 2)
            if int(last) - int(first) + 1 > max_points and int(total) > max_points and MIN_LEVEL <= shift <= MAX_LEVEL:
                batch[(r, k)] = (shift, int(total))
    items = list(batch.items())
    for c in range(0, len(items), 64):  # 64 series a query keeps the statement small to plan
        chunk = items[c:c + 64]
        where = " OR ".join(f"(run_id = :r{i} AND key = :k{i} AND level = :l{i})" for i in range(len(chunk)))
        params = {}
        for i, ((r, k), (lv, _)) in enumerate(chunk):
            params.update({f"r{i}": r, f"k{i}": k, f"l{i}": lv})
        rows = session.execute(text(f"SELECT run_id, key, {_POINT_COLUMNS} FROM metric_rollups WHERE {where} "
                                    "ORDER BY run_id, key, bucket"), params).all()
        grouped: dict[tuple[int, str], list] = {}
        for row in rows:
            grouped.setdefault((row[0], row[1]), []).append(row[2:])
        for pair, (_, total) in chunk:
            pts = _emit(grouped.get(pair, []), max_points)
            if pts is not None:
                out[pair] = _as_series(pair[1], pts, downsampled=True, total=total)
    for r, k in pairs:
        if (r, k) not in out:
            out[(r, k)] = read_series(session, r, k, max_points=max_points, x=x, x_min=x_min, x_max=x_max)
    return out


def _read_without_rollup(session: Session, run_id: int, key: str, max_points: int, x: str, x_min: float | None,
                         x_max: float | None) -> Series:
    """Rows stored around `ingest` (a bulk load) without `rebuild_rollup` afterwards: the same answer, computed
    from every raw row (slow on long series, hence the warning)."""
    log.warning("run %s key %r has raw points but no rollup; answering from raw rows. Run "
                "backend.services.metrics.rebuild_rollup(session, %s) once to make this fast", run_id, key, run_id)
    pts = _raw(session, run_id, key, 0, 2**62)
    xi = Point._fields.index(x)
    pts = [p for p in pts if (x_min is None or (p[xi] is not None and p[xi] >= x_min))
           and (x_max is None or (p[xi] is not None and p[xi] <= x_max))]
    if len(pts) <= max_points:
        return _as_series(key, pts, downsampled=False)
    buckets = bucketize(pts, _shift_for(pts[0].step, pts[-1].step, max_points // 2))
    while True:
        out = [p for b in sorted(buckets) for p in buckets[b].points()]
        if len(out) <= max_points:
            return _as_series(key, out, downsampled=True, total=len(pts))
        buckets = coarsen(buckets, 1)


def _as_series(key: str, pts: list[Point], *, downsampled: bool, total: int | None = None) -> Series:
    return Series.model_construct(key=key, step=[p[0] for p in pts], tokens=[p[1] for p in pts],
                                  wall_time=[p[2] for p in pts], value=[p[3] for p in pts],
                                  total_points=len(pts) if total is None else total, downsampled=downsampled)
