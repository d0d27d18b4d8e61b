"""The metric rollup and the downsampled series read from it, against real SQLite and PostgreSQL.

The reference ("brute force", tests/backend/test_rollup.py) is computed straight from the list of points, with
the rules the rollup promises: fixed buckets of 2**level steps; per bucket the minimum point, the maximum point
(ties: earliest step), the first point with a non-finite (NULL) value, counts and sums.
"""
from __future__ import annotations

import math
import random

import pytest
from sqlalchemy import text

from backend.db import session_factory
from backend.migrate import upgrade
from backend.schemas import MetricBatch, MetricPointIn, metric_series
from backend.services import metrics
from backend.services.rollup import LEVELS
from tests.backend.test_api import create, make_client
from tests.backend.test_rollup import brute_buckets, random_series

KEY = "train/loss"


@pytest.fixture
def env(database_url, tmp_path):
    """(API client, a session on the same database, the ids of three runs)."""
    api = make_client(database_url, tmp_path)
    run_ids = [r["id"] for r in create(api)["runs"]]
    session = session_factory(database_url)()
    yield api, session, run_ids
    session.close()


def as_in(pts, key=KEY) -> dict[str, list[tuple]]:
    """Points through the API's row-form schema, as the route hands them to the service."""
    rows = [MetricPointIn(key=key, step=s, tokens=t, wall_time=w, value=v) for s, t, w, v in pts]
    return metric_series(MetricBatch(points=rows))


def ingest(session, run_id, pts, key=KEY, batch=1000):
    for i in range(0, len(pts), batch):
        metrics.ingest(session, run_id, as_in(pts[i:i + batch], key))
    session.commit()


def stored_buckets(session, run_id, level, key=KEY) -> dict[int, dict]:
    rows = session.execute(text(
        "SELECT bucket, n_points, n_value, sum_value, first_step, last_step, min_step, min_tokens, min_wall_time, "
        "min_value, max_step, max_tokens, max_wall_time, max_value, null_step, null_tokens, null_wall_time "
        "FROM metric_rollups WHERE run_id = :r AND key = :k AND level = :l"),
        {"r": run_id, "k": key, "l": level}).all()
    return {r[0]: {"n_points": r[1], "n_value": r[2], "sum_value": r[3], "first_step": r[4], "last_step": r[5],
                   "min": None if r[9] is None else tuple(r[6:10]), "max": None if r[13] is None else tuple(r[10:14]),
                   "null": None if r[14] is None else tuple(r[14:17])} for r in rows}


def assert_rollup_matches(session, run_id, pts, key=KEY):
    for level in LEVELS:
        want, got = brute_buckets(pts, level), stored_buckets(session, run_id, level, key)
        assert got.keys() == want.keys(), f"level {level}"
        for b, w in want.items():
            g = got[b]
            assert g["sum_value"] == pytest.approx(w.pop("sum_value"), rel=1e-9, abs=1e-9), (level, b)
            g.pop("sum_value")
            assert g == w, f"level {level} bucket {b}"


def expected_answer(pts, max_points, lo=None, hi=None):
    """The documented answer: all points when they fit, else per bucket of the finest power-of-two width giving
    at most max_points / 2 buckets over lo..hi its min, max and first NULL point (coarser if that overflows)."""
    pts = [p for p in sorted(pts) if (lo is None or p[0] >= lo) and (hi is None or p[0] <= hi)]
    if len(pts) <= max_points:
        return pts
    lo, hi = pts[0][0] if lo is None else lo, pts[-1][0] if hi is None else hi
    k = 0
    while (hi >> k) - (lo >> k) + 1 > max_points // 2:
        k += 1
    while True:
        chosen = set()
        for b in brute_buckets(pts, k).values():
            chosen.update(p[0] for p in (b["min"], b["max"], b["null"]) if p is not None)
        if len(chosen) <= max_points:
            return [p for p in pts if p[0] in chosen]
        k += 1


def answer(series):
    return list(zip(series.step, series.tokens, series.wall_time, series.value))


def test_the_rollup_equals_a_brute_force_computation_at_every_level(env):
    _, session, (run, other, _) = env
    pts = random_series(3000, seed=1)
    # out of order batches, as concurrent workers may deliver them
    shuffled = pts[:]
    random.Random(2).shuffle(shuffled)
    ingest(session, run, shuffled, batch=700)
    ingest(session, other, random_series(500, seed=3, first_step=10**9, stride=7), key="val/loss")
    assert_rollup_matches(session, run, pts)
    assert_rollup_matches(session, other, random_series(500, seed=3, first_step=10**9, stride=7), key="val/loss")


def test_re_sent_and_overlapping_batches_are_not_counted_twice(env):
    _, session, (run, _, _) = env
    pts = random_series(2000, seed=4)
    ingest(session, run, pts, batch=500)
    ingest(session, run, pts, batch=500)  # a retry of everything
    # an overlapping batch whose repeated steps carry other values: the first value written wins
    overlap = [(s, t, w, 99.0) for s, t, w, _ in pts[1500:]] + [(s, s * 1024, 0.0, 1.0) for s in range(2000, 2100)]
    inserted, dupes = metrics.ingest(session, run, as_in(overlap))
    session.commit()
    assert (inserted, dupes) == (100, 500)
    assert_rollup_matches(session, run, pts + [(s, s * 1024, 0.0, 1.0) for s in range(2000, 2100)])


def test_two_writers_of_the_same_steps_at_once_store_each_point_once(env, database_url):
    """The second writer's insert meets the first's uncommitted rows: it waits, then stores only what is left
    (on PostgreSQL through the ON CONFLICT fallback after the unique key refused its plain insert)."""
    import threading

    _, first, (run, _, _) = env
    pts = random_series(300, seed=11)
    metrics.ingest(first, run, as_in(pts[:200]))  # not committed yet
    second = session_factory(database_url)()
    result = {}

    def write():
        result["counts"] = metrics.ingest(second, run, as_in(pts[100:]))
        second.commit()

    t = threading.Thread(target=write)
    t.start()
    t.join(timeout=1.0)
    assert t.is_alive(), "the second writer should wait for the first's transaction"
    first.commit()
    t.join(timeout=30)
    second.close()
    assert result["counts"] == (100, 100)
    assert_rollup_matches(first, run, pts)


@pytest.mark.parametrize("max_points", [4, 10, 64, 500, 2999, 5000])
def test_the_downsampled_series_is_the_min_max_and_null_of_each_bucket(env, max_points):
    _, session, (run, _, _) = env
    pts = random_series(3000, seed=5)
    ingest(session, run, pts, batch=3000)
    s = metrics.read_series(session, run, KEY, max_points=max_points)
    assert answer(s) == expected_answer(pts, max_points)
    assert len(s.step) <= max_points and s.total_points == 3000
    assert s.downsampled == (max_points < 3000)
    if max_points >= 10:  # with 5 buckets or more every bucket fits its three points
        assert len(s.step) > max_points / 4


def test_a_one_step_spike_and_a_non_finite_point_survive_every_level(env):
    _, session, (run, _, _) = env
    n, spike, nan_at = 30_000, 23_210, 12_345
    pts = [(s, s, float(s), 2.0 + 0.5 * math.cos(s / 500)) for s in range(n)]
    pts[spike] = (spike, spike, float(spike), 1e6)
    pts[nan_at] = (nan_at, nan_at, float(nan_at), None)
    ingest(session, run, pts, batch=10_000)
    for max_points in (4, 8, 16, 100, 1000, 10_000):
        s = metrics.read_series(session, run, KEY, max_points=max_points)
        got = dict(zip(s.step, s.value))
        assert len(s.step) <= max_points
        assert got.get(spike) == 1e6, max_points
        assert nan_at in got and got[nan_at] is None, max_points


def test_zooming_reads_only_the_window_with_exact_edges(env):
    _, session, (run, _, _) = env
    pts = random_series(3000, seed=6, first_step=5, stride=3)  # steps 5, 8, ..., 9002
    ingest(session, run, pts, batch=1000)
    for lo, hi, mp in [(1000, 7000, 100), (1001, 1500, 40), (0, 40, 4), (4000, 4600, 400), (6000, 10**7, 50)]:
        s = metrics.read_series(session, run, KEY, max_points=mp, x_min=lo, x_max=hi)
        want = expected_answer(pts, mp, lo=max(lo, 5), hi=min(hi, 9002))
        assert answer(s) == want, (lo, hi, mp)
        assert all(lo <= st <= hi for st in s.step)
    # the same window given in tokens and in wall time
    by_step = metrics.read_series(session, run, KEY, max_points=100, x_min=1000, x_max=7000)
    assert answer(metrics.read_series(session, run, KEY, max_points=100, x="tokens", x_min=1000 * 1024,
                                      x_max=7000 * 1024)) == answer(by_step)
    assert answer(metrics.read_series(session, run, KEY, max_points=100, x="wall_time", x_min=1500.0,
                                      x_max=4500.0)) == answer(by_step)
    # a window with a few points comes back raw, and an empty one empty
    few = metrics.read_series(session, run, KEY, max_points=100, x_min=100, x_max=400)
    assert not few.downsampled and answer(few) == [p for p in pts if 100 <= p[0] <= 400]
    assert metrics.read_series(session, run, KEY, x_min=9003).step == []


def test_a_sparse_long_series_comes_back_whole(env):
    _, session, (run, _, _) = env
    pts = [(s, s, float(s), 1.0 / (1 + s)) for s in range(0, 100_000, 100)]  # val/loss every 100 steps
    ingest(session, run, pts, key="val/loss")
    s = metrics.read_series(session, run, "val/loss", max_points=1000)
    assert not s.downsampled and len(s.step) == 1000


def test_unknown_keys_and_bad_arguments(env):
    _, session, (run, _, _) = env
    empty = metrics.read_series(session, run, "no/such/key")
    assert empty.step == [] and empty.total_points == 0
    for kwargs, fragment in [({"x": "epoch"}, "x must be one of"), ({"max_points": 3}, "at least 4"),
                             ({"x_min": 5, "x_max": 1}, "must not exceed"), ({"x_min": math.nan}, "finite")]:
        with pytest.raises(ValueError, match=fragment):
            metrics.read_series(session, run, KEY, **kwargs)


def test_rows_loaded_around_ingest_are_answered_raw_then_fast_after_a_rebuild(env):
    _, session, (run, other, _) = env
    pts = random_series(2500, seed=7)
    ingest(session, other, pts)
    want = answer(metrics.read_series(session, other, KEY, max_points=300))
    # a bulk load straight into the table, as bench/dashboard_bench.py does with COPY
    session.execute(text("INSERT INTO metric_points (run_id, key, step, tokens, wall_time, value) "
                         "VALUES (:r, :k, :s, :t, :w, :v)"),
                    [{"r": run, "k": KEY, "s": s, "t": t, "w": w, "v": v} for s, t, w, v in pts])
    session.commit()
    assert answer(metrics.read_series(session, run, KEY, max_points=300)) == want
    assert metrics.rebuild_rollup(session, run) > 0
    session.commit()
    assert_rollup_matches(session, run, pts)
    assert answer(metrics.read_series(session, run, KEY, max_points=300)) == want
    with pytest.raises(ValueError, match="positive integer"):
        metrics.rebuild_rollup(session, -1)


def test_the_migration_backfills_series_stored_before_it(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    upgrade(url, "0001")
    session = session_factory(url)()
    session.execute(text("INSERT INTO experiments (id, name, description, model_config, data_config, "
                         "training_config, seed, recipes, baseline, eval_tasks, created_at) VALUES "
                         "(1, 'e', '', '{}', '{}', '{}', 0, '[]', 'bf16', '[]', '2026-01-01')"))
    session.execute(text("INSERT INTO runs (id, experiment_id, recipe, recipe_options, bf16_first_layers, "
                         "bf16_last_layers, label, spec, external, status, cancel_requested, created_at, progress, "
                         "summary, conversion_report, attempts) VALUES (1, 1, 'bf16', '{}', 0, 0, '', '{}', 0, "
                         "'succeeded', 0, '2026-01-01', '{}', '{}', '{}', 0)"))
    pts = random_series(1500, seed=8)
    session.execute(text("INSERT INTO metric_points (run_id, key, step, tokens, wall_time, value) "
                         "VALUES (1, :k, :s, :t, :w, :v)"),
                    [{"k": KEY, "s": s, "t": t, "w": w, "v": v} for s, t, w, v in pts])
    session.commit()
    session.close()
    upgrade(url)
    session = session_factory(url)()
    assert_rollup_matches(session, 1, pts)
    session.close()


def test_the_experiment_series_endpoint_answers_every_run_and_key(env):
    api, session, (a, b, c) = env
    ingest(session, a, random_series(3000, seed=9))
    ingest(session, b, random_series(100, seed=10))
    r = api.get(f"/api/v1/runs/{a}")
    exp_id = r.json()["experiment_id"]
    body = api.get(f"/api/v1/experiments/{exp_id}/series?keys=train/loss,nope&max_points=200").json()
    by_run = {run["run_id"]: run["series"] for run in body["runs"]}
    assert set(by_run) == {a, b, c} and body["keys"] == ["train/loss", "nope"]
    assert by_run[a]["train/loss"]["downsampled"] and len(by_run[a]["train/loss"]["step"]) <= 200
    assert by_run[a]["train/loss"]["step"] == metrics.read_series(session, a, KEY, max_points=200).step
    assert len(by_run[b]["train/loss"]["step"]) == 100 and by_run[c]["train/loss"]["step"] == []
    assert by_run[a]["nope"] == {"step": [], "tokens": [], "wall_time": [], "value": [], "total_points": 0,
                                 "downsampled": False}
    # the endpoint's batched read answers exactly what read_series answers, pair by pair, at several sizes
    ingest(session, c, random_series(2000, seed=11), key="train/lr")
    for mp in (4, 50, 150, 5000):
        many = metrics.read_many(session, [a, b, c], [KEY, "train/lr", "nope"], max_points=mp)
        for (run, key), s in many.items():
            assert s == metrics.read_series(session, run, key, max_points=mp), (run, key, mp)
    bad = api.get(f"/api/v1/experiments/{exp_id}/series?x=epoch")
    assert bad.status_code == 422 and "x" in bad.json()["detail"]
