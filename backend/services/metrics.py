"""Metric ingest (idempotent on run+key+step) and min/max-preserving downsampling from a rollup.

Reading a long series by scanning its raw rows costs tens of milliseconds per series on PostgreSQL however it
is written (bench/dashboard_bench.py measured it), so the dashboard reads pre-computed buckets instead:
`metric_rollups` holds, per (run, key), levels 4..24 of fixed power-of-two step buckets (`bucket = step >> level`).
Ingest merges each newly inserted point into its bucket at every level, in the same transaction as the raw
insert; only rows the raw insert really stored are merged, so a re-sent batch changes nothing.

What a bucket keeps, and how buckets merge, is `backend.services.rollup` (pure arithmetic); this module is the
database side: the upsert that merges buckets in SQL by the same rules, and the reads.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from sqlalchemy import and_, bindparam, case, cast, delete, func, or_, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from backend.errors import InvalidInput
from backend.models import MetricPoint, MetricRollup
from backend.schemas import Series
from backend.services.rollup import (MAX_LEVEL, MIN_LEVEL, ROLLUP_COLUMNS, Agg, Point, bucketize, coarsen, downsample,
                                     rollup_levels_columns, shift_for)

log = logging.getLogger(__name__)
_X_COLUMNS = {"step": "step", "tokens": "tokens", "wall_time": "wall_time"}
_ROLLUP_SELECT = ", ".join(ROLLUP_COLUMNS)


# ---------------------------------------------------------------------------------------------- writing
def _insert_fn(session: Session):
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert


_UPSERTS: dict[tuple, object] = {}


def _merge_rollup(session: Session, rows: list[dict]) -> None:
    """Upsert bucket rows, merging into stored buckets with the same rules as `Agg.add`."""
    if not rows:
        return
    pg = session.get_bind().dialect.name == "postgresql"
    names = list(rows[0])
    cache_key = (pg, tuple(names))
    upsert = _UPSERTS.get(cache_key)
    if upsert is None:
        upsert = _UPSERTS[cache_key] = _rollup_upsert(session, pg, names)
    if pg:
        _driver_execute(session, upsert, {f"a_{n}": [r[n] for r in rows] for n in names})
    else:
        _driver_executemany(session, upsert, rows)


def _rollup_upsert(session: Session, pg: bool, names: list[str]):
    """The upsert statement of `_merge_rollup` (built once per dialect: building it costs more than running it)."""
    insert = _insert_fn(session)
    t = MetricRollup.__table__.c
    table = MetricRollup.__table__
    if pg:
        # PostgreSQL: every column as one array parameter of a single INSERT ... SELECT unnest(...) (see
        # _PG_INSERT), in the rows' (lock) order.
        arrays = [cast(bindparam(f"a_{n}"), postgresql.ARRAY(table.c[n].type)) for n in names]
        u = func.unnest(*arrays).table_valued(*names, with_ordinality="ord").render_derived()
        stmt = insert(table).from_select(names, select(*[u.c[n] for n in names]).order_by(u.c.ord))
    else:
        stmt = insert(table)
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
    upsert = stmt.on_conflict_do_update(index_elements=["run_id", "key", "level", "bucket"], set_=set_)
    if not pg:
        # SQLite: the SQL text with named parameters, executed by the driver over the rows (SQLAlchemy's
        # executemany processed every row's parameters in Python: half of a 200-point request's time).
        return str(upsert.compile(dialect=sqlite.dialect(paramstyle="named")))
    # PostgreSQL: the SQL text, its array parameters in the binary format (see _PG_INSERT).
    sql = str(upsert.compile(dialect=session.get_bind().dialect))
    for n in names:
        sql = sql.replace(f"%(a_{n})s", f"%(a_{n})b")
    return sql


def _rollup_rows(run_id: int, key: str, points: Sequence[tuple]) -> list[dict]:
    """The bucket rows of `points` ((step, value, tokens, wall_time) tuples) at every level, in one lock order."""
    steps, values, tokens, walls = zip(*points) if points else ((), (), (), ())
    levels = rollup_levels_columns(steps, values, tokens, walls)
    rows = [a.row(run_id, key, lv, b) for lv, buckets in levels.items() for b, a in buckets.items()]
    return sorted(rows, key=lambda r: (r["level"], r["bucket"]))  # one lock order for every writer


# A batch first looks up which of its steps are stored (one index range scan per key; none, for a run logging
# forward) and inserts the others plainly, in a savepoint: ON CONFLICT's speculative insertion cost as much again
# as the insert itself on PostgreSQL (10,000 rows: ~75 ms against ~37 ms). A concurrent writer of the same steps
# makes the plain insert fail on the unique key: then the batch goes again with ON CONFLICT DO NOTHING RETURNING,
# which names what was really inserted.
# PostgreSQL: the plain insert is a binary COPY (_PgPoints.insert); the ON CONFLICT fallback sends the whole batch
# as five array parameters of one statement. The multi-row VALUES form SQLAlchemy builds instead has a placeholder
# per value, which the driver re-parses client-side for every batch (most of the time of a 10,000-point request
# went there: ~8k points/s from one client on this machine).
# The arrays go in psycopg's binary format (%(name)b: dumped in C, where the text format quotes element by element).
_PG_INSERT = (
    "INSERT INTO metric_points (run_id, key, step, value, tokens, wall_time) "
    "SELECT %(run_id)b, k, s, v, t, w FROM unnest(CAST(%(keys)b AS varchar[]), CAST(%(steps)b AS bigint[]), "
    "CAST(%(vals)b AS double precision[]), CAST(%(toks)b AS bigint[]), CAST(%(walls)b AS double precision[])) "
    "WITH ORDINALITY AS u(k, s, v, t, w, i) ORDER BY i")
_PG_STORED = ("SELECT m.key, m.step FROM metric_points m JOIN unnest(CAST(%(keys)b AS varchar[]), "
              "CAST(%(los)b AS bigint[]), CAST(%(his)b AS bigint[])) AS r(k, lo, hi) "
              "ON m.run_id = %(run_id)b AND m.key = r.k AND m.step BETWEEN r.lo AND r.hi")
_PG_COPY = "COPY metric_points (run_id, key, step, value, tokens, wall_time) FROM STDIN (FORMAT BINARY)"
_PG_COPY_TYPES = ["int4", "text", "int8", "float8", "int8", "float8"]
# SQLite: the driver's executemany over tuples (a C loop).
_LITE_INSERT = "INSERT {} INTO metric_points (run_id, key, step, value, tokens, wall_time) VALUES (?, ?, ?, ?, ?, ?)"
_LITE_STORED = "SELECT key, step FROM metric_points WHERE run_id = ? AND key = ? AND step BETWEEN ? AND ?"


def _driver_execute(session: Session, sql: str, params=None) -> list:
    """`sql` on the session's own driver connection (inside its transaction): psycopg for binary parameters,
    sqlite3 to skip SQLAlchemy's per-row parameter processing."""
    cur = session.connection().connection.driver_connection.cursor()
    try:
        cur.execute(sql, params) if params is not None else cur.execute(sql)
        return cur.fetchall() if cur.description else []
    finally:
        cur.close()


def _driver_executemany(session: Session, sql: str, rows) -> int:
    cur = session.connection().connection.driver_connection.cursor()
    try:
        cur.executemany(sql, rows)
        return cur.rowcount
    finally:
        cur.close()


def begin_write(session: Session) -> None:
    """SQLite: open the session's transaction with the database's write lock (BEGIN IMMEDIATE) unless one is open.
    sqlite3 begins a transaction only before its first INSERT: reads and a SAVEPOINT before it would run outside
    (and RELEASE of an outermost savepoint commits). IMMEDIATE: no other process writes between what this
    transaction reads (the run, the steps stored) and what it writes."""
    if not session.connection().connection.driver_connection.in_transaction:
        _driver_execute(session, "BEGIN IMMEDIATE")


def _only(batch: dict[str, list[tuple]], keep) -> dict[str, list[tuple]]:
    return {key: [p for p in pts if keep(key, p[0])] for key, pts in batch.items()}


class _PgPoints:
    """Metric rows on PostgreSQL (see _PG_INSERT)."""

    @staticmethod
    def stored(session: Session, run_id: int, batch: dict[str, list[tuple]]) -> set:
        keys = list(batch)
        return set(map(tuple, _driver_execute(session, _PG_STORED, {
            "run_id": run_id, "keys": keys, "los": [batch[k][0][0] for k in keys],
            "his": [batch[k][-1][0] for k in keys]})))

    @staticmethod
    def _columns(run_id: int, batch: dict[str, list[tuple]]) -> dict:
        cols = {"run_id": run_id, "keys": [], "steps": [], "vals": [], "toks": [], "walls": []}
        for key, pts in batch.items():
            if pts:
                cols["keys"].extend([key] * len(pts))
                for name, column in zip(("steps", "vals", "toks", "walls"), zip(*pts)):
                    cols[name].extend(column)
        return cols

    @staticmethod
    def insert(session: Session, run_id: int, batch: dict[str, list[tuple]]) -> None:
        # COPY in the binary format, rows in (key, step) order (the lock order): a 10,000-point batch in ~20 ms
        # where the unnest INSERT took ~30 ms (its arrays are dumped, then unpacked and projected on the server).
        # COPY has no ON CONFLICT; a concurrent writer's step fails it like the plain INSERT it replaces.
        cur = session.connection().connection.driver_connection.cursor()
        try:
            with cur.copy(_PG_COPY) as copy:
                copy.set_types(_PG_COPY_TYPES)
                write = copy.write_row
                for key, pts in batch.items():
                    for step, value, tokens, wall in pts:
                        write((run_id, key, step, value, tokens, wall))
        finally:
            cur.close()

    @classmethod
    def insert_new(cls, session: Session, run_id: int, batch: dict[str, list[tuple]]) -> set:
        return set(map(tuple, _driver_execute(session, _PG_INSERT + " ON CONFLICT (run_id, key, step) DO NOTHING "
                                              "RETURNING key, step", cls._columns(run_id, batch))))


class _LitePoints:
    """Metric rows on SQLite."""

    @staticmethod
    def stored(session: Session, run_id: int, batch: dict[str, list[tuple]]) -> set:
        return {tuple(row) for key, pts in batch.items() if pts
                for row in _driver_execute(session, _LITE_STORED, (run_id, key, pts[0][0], pts[-1][0]))}

    @staticmethod
    def insert(session: Session, run_id: int, batch: dict[str, list[tuple]], how: str = "") -> None:
        _driver_executemany(session, _LITE_INSERT.format(how),
                            [(run_id, key, p[0], p[1], p[2], p[3]) for key, pts in batch.items() for p in pts])

    @classmethod
    def insert_new(cls, session: Session, run_id: int, batch: dict[str, list[tuple]]) -> set:
        # This transaction already holds SQLite's write lock (the failed insert took it): nothing can land
        # between the lookup and the insert.
        before = cls.stored(session, run_id, batch)
        cls.insert(session, run_id, batch, "OR IGNORE")
        return {(key, p[0]) for key, pts in batch.items() for p in pts} - before


def _insert_points(session: Session, run_id: int, batch: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
    """Insert the points of `batch` ({key: [(step, value, tokens, wall_time)]}, keys and steps sorted),
    skipping (run, key, step) already stored; the points really inserted, in the same form."""
    import sqlite3

    import psycopg

    pg = session.get_bind().dialect.name == "postgresql"
    db, violation = (_PgPoints, psycopg.errors.UniqueViolation) if pg else (_LitePoints, sqlite3.IntegrityError)
    if not pg:
        begin_write(session)
    stored = db.stored(session, run_id, batch)
    if stored:
        batch = _only(batch, lambda key, step: (key, step) not in stored)
    if not any(batch.values()):
        return batch
    _driver_execute(session, "SAVEPOINT plab_ingest")
    try:
        db.insert(session, run_id, batch)
    except violation:
        # A concurrent writer stored some of these steps since the lookup: insert the others, learning which.
        _driver_execute(session, "ROLLBACK TO SAVEPOINT plab_ingest")
        kept = db.insert_new(session, run_id, batch)
        batch = _only(batch, lambda key, step: (key, step) in kept)
    _driver_execute(session, "RELEASE SAVEPOINT plab_ingest")
    return batch


def ingest(session: Session, run_id: int, series: dict[str, list[tuple]]) -> tuple[int, int]:
    """Insert points ({key: [(step, value, tokens, wall_time), ...]}, as `backend.schemas.metric_series` gives),
    ignoring (run, key, step) already stored, and merge the new ones into the rollup. Returns (inserted,
    duplicates).

    A retried batch therefore never duplicates (raw rows nor rollup counts), and the first value written for a
    step wins: a resumed run re-sending a step it already reported cannot rewrite history.

    Metric rows have no foreign key to the run: the caller holds the run locked (`services.runs.lock_run`).
    """
    received = sum(len(pts) for pts in series.values())
    if not received:
        return 0, 0
    # Collapse duplicates inside the batch itself (first wins), so the count is honest. Rows and rollup merges
    # go in (key, step) order: two writers of one run whose batches list keys in different orders then take
    # their row locks in the same order and cannot deadlock (PostgreSQL answered 503 to 70 of 327 such
    # concurrent requests when they did not).
    batch: dict[str, list[tuple]] = {}
    for key in sorted(series):
        unique: dict[int, tuple] = {}
        for p in series[key]:
            unique.setdefault(p[0], p)
        batch[key] = [unique[step] for step in sorted(unique)]
    # Only the points really inserted enter the rollup.
    batch = _insert_points(session, run_id, batch)
    # Every key's buckets in one statement, in (key, level, bucket) order: the same lock order for every writer.
    _merge_rollup(session, [row for key, pts in batch.items() if pts for row in _rollup_rows(run_id, key, pts)])
    inserted = sum(len(pts) for pts in batch.values())
    return inserted, received - inserted


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
        out = _rollup_rows(rid, key, [(step, value, tokens, wall) for step, tokens, wall, value in rows])
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
    shift = shift_for(lo, hi, max_points // 2)
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
    return _as_series(key, downsample(buckets, max_points), downsampled=True, total=total)


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
            shift = shift_for(int(first), int(last), max_points // 2)
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
    buckets = bucketize(pts, shift_for(pts[0].step, pts[-1].step, max_points // 2))
    return _as_series(key, downsample(buckets, max_points), downsampled=True, total=len(pts))


def _as_series(key: str, pts: list[Point], *, downsampled: bool, total: int | None = None) -> Series:
    return Series.model_construct(key=key, step=[p[0] for p in pts], tokens=[p[1] for p in pts],
                                  wall_time=[p[2] for p in pts], value=[p[3] for p in pts],
                                  total_points=len(pts) if total is None else total, downsampled=downsampled)
