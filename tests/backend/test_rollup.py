"""The rollup arithmetic on its own (no database): what a bucket keeps, where buckets start and end, how levels
merge, and the edge cases (no points, NULL values).

The reference ("brute force") below is computed straight from the list of points, with the rules the rollup
promises: fixed buckets of 2**level steps; per bucket the minimum point, the maximum point (ties: earliest
step), the first point with a non-finite (NULL) value, counts and sums. tests/backend/test_series.py holds the
database's rollup to the same reference.
"""
from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

from backend.services.rollup import (LEVELS, MAX_LEVEL, MIN_LEVEL, ROLLUP_COLUMNS, Agg, Point, bucketize,
                                     bucketize_columns, coarsen,
                                     downsample, rollup_levels, shift_for)
from tests.conftest import REPO


def random_series(n: int, seed: int, *, first_step: int = 0, stride: int = 1) -> list[tuple]:
    """(step, tokens, wall_time, value) with noise, repeated values (ties), spikes and NULL runs."""
    rng = random.Random(seed)
    pts = []
    for i in range(n):
        step = first_step + i * stride
        v = round(3 + math.sin(i / 40) + rng.gauss(0, 0.1), 2)  # rounded: equal values happen
        if rng.random() < 0.01:
            v = rng.choice([50.0, -20.0])
        if rng.random() < 0.01:
            v = None
        pts.append((step, step * 1024, 1000.0 + 0.5 * step, v))
    return pts


def brute_buckets(pts, level) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for s, t, w, v in sorted(pts):
        b = out.setdefault(s >> level, {"n_points": 0, "n_value": 0, "sum_value": 0.0, "first_step": s,
                                        "last_step": s, "min": None, "max": None, "null": None})
        b["n_points"] += 1
        b["last_step"] = s
        if v is None:
            b["null"] = b["null"] or (s, t, w)
            continue
        b["n_value"] += 1
        b["sum_value"] += v
        if b["min"] is None or v < b["min"][3]:
            b["min"] = (s, t, w, v)
        if b["max"] is None or v > b["max"][3]:
            b["max"] = (s, t, w, v)
    return out


def as_brute(a: Agg) -> dict:
    """An Agg in the reference's shape."""
    return {"n_points": a.n_points, "n_value": a.n_value, "sum_value": a.sum_value, "first_step": a.first_step,
            "last_step": a.last_step, "min": None if a.min is None else tuple(a.min),
            "max": None if a.max is None else tuple(a.max), "null": None if a.null is None else tuple(a.null[:3])}


def assert_same_buckets(got: dict[int, Agg], want: dict[int, dict], context) -> None:
    assert got.keys() == want.keys(), context
    for b, w in want.items():
        g = as_brute(got[b])
        assert g.pop("sum_value") == pytest.approx(w["sum_value"], rel=1e-9, abs=1e-9), (context, b)
        assert g == {k: v for k, v in w.items() if k != "sum_value"}, (context, b)


def points(pts) -> list[Point]:
    return [Point(*p) for p in pts]


def test_every_level_holds_what_the_brute_force_reference_holds():
    pts = random_series(5000, seed=3, first_step=7, stride=3)
    levels = rollup_levels(points(pts))
    assert tuple(levels) == LEVELS
    for level, buckets in levels.items():
        assert_same_buckets(buckets, brute_buckets(pts, level), level)


def test_a_one_step_spike_and_dip_survive_every_level_and_the_downsampled_answer():
    pts = [(s, s * 8, float(s), 2.0) for s in range(100_000)]
    pts[12_345] = (12_345, 12_345 * 8, 12_345.0, 50.0)
    pts[777] = (777, 777 * 8, 777.0, -20.0)
    for level, buckets in rollup_levels(points(pts)).items():
        assert buckets[12_345 >> level].max == Point(*pts[12_345]), level
        assert buckets[777 >> level].min == Point(*pts[777]), level
    shown = downsample(bucketize(points(pts), shift_for(0, 99_999, 50)), 100)
    assert len(shown) <= 100
    assert Point(*pts[12_345]) in shown and Point(*pts[777]) in shown


def test_ties_keep_the_earliest_step_for_both_the_minimum_and_the_maximum():
    a = bucketize(points([(5, None, None, 1.0), (3, None, None, 1.0), (9, None, None, 1.0)]), 4)[0]
    assert a.min.step == 3 and a.max.step == 3
    assert a.points() == [Point(3, None, None, 1.0)]  # one point when min and max are the same point


def test_buckets_are_fixed_power_of_two_step_ranges():
    buckets = bucketize(points([(s, None, None, float(s)) for s in (0, 15, 16, 31, 32, 100)]), 4)
    assert sorted(buckets) == [0, 1, 2, 6]
    assert [(buckets[b].first_step, buckets[b].last_step, buckets[b].n_points) for b in sorted(buckets)] == [
        (0, 15, 2), (16, 31, 2), (32, 32, 1), (100, 100, 1)]
    assert shift_for(0, 15, 1) == 4 and shift_for(0, 16, 1) == 5 and shift_for(16, 31, 1) == 4
    assert shift_for(0, 99, 100) == 0 and shift_for(0, 100, 100) == 1
    assert (99 >> shift_for(0, 99, 7)) - (0 >> shift_for(0, 99, 7)) + 1 <= 7


def test_coarsening_equals_bucketizing_at_the_coarser_width_and_leaves_the_finer_level_as_it_was():
    pts = random_series(3000, seed=11)
    fine = bucketize(points(pts), MIN_LEVEL)
    before = {b: as_brute(a) for b, a in fine.items()}
    for by in (0, 1, 3, 7):
        assert_same_buckets(coarsen(fine, by), brute_buckets(pts, MIN_LEVEL + by), by)
    assert {b: as_brute(a) for b, a in fine.items()} == before
    assert_same_buckets(coarsen(coarsen(fine, 2), 3), brute_buckets(pts, MIN_LEVEL + 5), "twice")


def test_merging_does_not_depend_on_the_order_of_the_points():
    pts = random_series(2000, seed=5)
    shuffled = pts[:]
    random.Random(0).shuffle(shuffled)
    for level in (MIN_LEVEL, 8, MAX_LEVEL):
        assert_same_buckets(bucketize(points(shuffled), level), brute_buckets(pts, level), level)


def test_no_points_give_no_buckets_and_an_empty_answer():
    assert bucketize([], MIN_LEVEL) == {}
    assert all(b == {} for b in rollup_levels([]).values())
    assert coarsen({}, 3) == {}
    assert downsample({}, 10) == []


def test_null_values_are_counted_kept_as_the_first_null_point_and_left_out_of_sums_and_extremes():
    a = bucketize(points([(0, 0, 0.0, 1.0), (1, 8, 0.1, None), (2, 16, 0.2, 3.0), (3, 24, 0.3, None)]), 4)[0]
    assert (a.n_points, a.n_value, a.sum_value, a.sum_step) == (4, 2, 4.0, 2.0)
    assert (a.n_tokens, a.sum_tokens) == (2, 16.0)
    assert a.null == Point(1, 8, 0.1, None) and a.min.value == 1.0 and a.max.value == 3.0
    assert [p.step for p in a.points()] == [0, 1, 2]  # min, first NULL and max, in step order
    only_nulls = bucketize(points([(40, None, None, None), (33, None, None, None)]), 4)[2]
    assert only_nulls.min is None and only_nulls.max is None and only_nulls.n_value == 0
    assert only_nulls.points() == [Point(33, None, None, None)]


def test_downsampling_coarsens_until_null_points_fit():
    # Every 16-step bucket shows three points (min, NULL, max): 64 buckets are 192 points, over the 100 asked.
    pts = [(s, None, None, None if s % 16 == 8 else float(s % 7)) for s in range(1024)]
    shown = downsample(bucketize(points(pts), 4), 100)
    assert 0 < len(shown) <= 100
    assert [p.step for p in shown] == sorted(p.step for p in shown)
    assert any(p.value is None for p in shown)


def test_a_bucket_row_reads_back_as_the_same_bucket_in_the_rollup_column_order():
    for a in bucketize(points(random_series(500, seed=2)), 6).values():
        row = a.row(run_id=1, key="train/loss", level=6, bucket=0)
        back = Agg.from_row(tuple(row[c] for c in ROLLUP_COLUMNS))
        assert as_brute(back) == as_brute(a)


def test_the_arithmetic_imports_no_database_library():
    code = "import sys, backend.services.rollup; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('sqlalchemy', 'psycopg', 'sqlite3', 'fastapi')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("seed", range(4))
def test_the_columnar_bucketing_equals_the_point_by_point_one(seed):
    """Ingest buckets with numpy (`bucketize_columns`); `bucketize` (Agg by Agg) is the definition. Unsorted input,
    repeated steps (first sent wins), missing tokens and NULL values included."""
    rng = random.Random(seed)
    pts = [Point(s, None if rng.random() < 0.1 else t, w, v) for s, t, w, v in random_series(700, seed=seed)]
    pts += [Point(p.step, p.tokens, p.wall_time, 99.0) for p in rng.sample(pts, 20)]  # repeats, sent later
    rng.shuffle(pts)
    for shift in (0, 4, 7):
        got = bucketize_columns([p.step for p in pts], [p.value for p in pts], [p.tokens for p in pts],
                                [p.wall_time for p in pts], shift)
        want = bucketize(sorted(pts, key=lambda p: p.step), shift)  # a stable sort: the same first-sent order
        assert got.keys() == want.keys()
        for b in want:
            g, w = got[b], want[b]
            assert g.sum_value == pytest.approx(w.sum_value, rel=1e-12, abs=1e-12)
            assert [getattr(g, f) for f in Agg.__slots__ if f != "sum_value"] == \
                   [getattr(w, f) for f in Agg.__slots__ if f != "sum_value"], (shift, b)
    assert bucketize_columns([], [], [], [], 4) == {}
