"""Rollup arithmetic: min/max-preserving buckets of a metric series, pure (no database).

A bucket of 2**level steps (`bucket = step >> level`) keeps its minimum point, its maximum point (ties: the
earliest step), its first point whose value is non-finite (NULL) and sums for bucket means. Merging two buckets
(`Agg.add`) does not depend on their order (up to the rounding of the float sums), so the buckets of one level
merge into those of the next (`coarsen`), and points merged at ingest batch by batch give the buckets a full
recomputation gives. A one-step spike is the
maximum of every bucket that holds it, so it survives every level; a NULL point likewise.
`backend.services.metrics` stores these buckets (`metric_rollups`) and reads them back.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

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
ROLLUP_COLUMNS = ("bucket", "n_points", "n_value", "sum_value", "sum_step", "n_tokens", "sum_tokens", "first_step",
                   "last_step", "min_value", "min_step", "min_tokens", "min_wall_time", "max_value", "max_step",
                   "max_tokens", "max_wall_time", "null_step", "null_tokens", "null_wall_time")


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


def bucketize_columns(steps, values, tokens, walls, shift: int) -> dict[int, Agg]:
    """`bucketize` for points given as columns (None where a value, token count or wall time is missing), in
    numpy: the same buckets, ties and sums (up to the rounding of `sum_value`) at ~0.2 us a point instead of
    ~3 us, which was a fifth of a metric batch's ingest time."""
    n = len(steps)
    if n == 0:
        return {}
    step = np.asarray(steps, dtype=np.int64)
    order = np.argsort(step, kind="stable")  # stable: among equal steps the first sent wins, as in Agg.add
    step = step[order]
    value = np.array(values, dtype=np.float64)[order]  # None -> nan
    has = ~np.isnan(value)
    tok_known = np.array([t is not None for t in tokens], dtype=bool)[order]
    token = np.array([0 if t is None else t for t in tokens], dtype=np.int64)[order]
    bucket = step >> shift
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    ends = np.r_[starts[1:], n]
    idx = np.arange(n)

    def first(mask):  # the first index of each bucket where mask holds, n where none
        return np.minimum.reduceat(np.where(mask, idx, n), starts)

    sums = {"n_value": np.add.reduceat(has.astype(np.int64), starts),
            "sum_value": np.add.reduceat(np.where(has, value, 0.0), starts),
            "sum_step": np.add.reduceat(np.where(has, step, 0).astype(np.float64), starts),
            "n_tokens": np.add.reduceat((has & tok_known).astype(np.int64), starts),
            "sum_tokens": np.add.reduceat(np.where(has & tok_known, token, 0).astype(np.float64), starts)}
    seg = np.repeat(np.arange(len(starts)), ends - starts)
    lo = np.minimum.reduceat(np.where(has, value, np.inf), starts)
    hi = np.maximum.reduceat(np.where(has, value, -np.inf), starts)
    i_min, i_max, i_null = first(has & (value == lo[seg])), first(has & (value == hi[seg])), first(~has)

    def point(i: int) -> Point | None:
        if i == n:
            return None
        j = int(order[i])
        return Point(int(step[i]), tokens[j], walls[j], values[j])

    out: dict[int, Agg] = {}
    for g, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        a = Agg.__new__(Agg)
        a.n_points, a.first_step, a.last_step = e - s, int(step[s]), int(step[e - 1])
        a.n_value, a.n_tokens = int(sums["n_value"][g]), int(sums["n_tokens"][g])
        a.sum_value, a.sum_step = float(sums["sum_value"][g]), float(sums["sum_step"][g])
        a.sum_tokens = float(sums["sum_tokens"][g])
        a.min, a.max, a.null = point(int(i_min[g])), point(int(i_max[g])), point(int(i_null[g]))
        out[int(bucket[s])] = a
    return out


def rollup_levels(points: Iterable[Point]) -> dict[int, dict[int, Agg]]:
    """Every level's buckets for a set of points: level 4 from the points, each next level from the previous."""
    pts = list(points)
    return rollup_levels_columns([p.step for p in pts], [p.value for p in pts], [p.tokens for p in pts],
                                 [p.wall_time for p in pts])


def rollup_levels_columns(steps, values, tokens, walls) -> dict[int, dict[int, Agg]]:
    """`rollup_levels` for points given as columns."""
    levels = {MIN_LEVEL: bucketize_columns(steps, values, tokens, walls, MIN_LEVEL)}
    for lv in LEVELS[1:]:
        levels[lv] = coarsen(levels[lv - 1], 1)
    return levels


def shift_for(lo: int, hi: int, n_buckets: int) -> int:
    """The finest power-of-two bucket width (as a shift) giving at most n_buckets buckets over steps lo..hi."""
    k = 0
    while (hi >> k) - (lo >> k) + 1 > n_buckets:
        k += 1
    return k


def downsample(buckets: dict[int, Agg], max_points: int) -> list[Point]:
    """The points of the buckets (`Agg.points`) in step order, coarsening until at most max_points remain (NULL
    points can make a bucket show three points; one width coarser halves the buckets)."""
    while True:
        pts = [p for b in sorted(buckets) for p in buckets[b].points()]
        if len(pts) <= max_points:
            return pts
        buckets = coarsen(buckets, 1)
