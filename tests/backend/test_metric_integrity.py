"""Metric points without a foreign key to their run (migration 0007): the run locks keep every point attached to
an existing run when ingest and deletion race, against real SQLite and PostgreSQL; the migration keeps the points
both ways."""
from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa
from alembic import command

from backend.db import session_factory
from backend.errors import NotFound
from backend.migrate import alembic_config, upgrade
from backend.services import housekeeping, runs
from tests.backend.test_api import create, make_client

KEY = "train/loss"


def _batch(first: int, n: int = 500) -> dict[str, list[tuple]]:
    return {KEY: [(s, 1.0 / (s + 1), 64 * s, 1.8e9 + s) for s in range(first, first + n)],
            "train/lr": [(s, 1e-3, 64 * s, 1.8e9 + s) for s in range(first, first + n)]}


def _orphans(session) -> tuple[int, int]:
    return tuple(session.execute(sa.text(
        f"SELECT COUNT(*) FROM {table} m WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = m.run_id)")).scalar()
        for table in ("metric_points", "metric_rollups"))


def _count(session, run_id: int) -> int:
    return session.execute(sa.text("SELECT COUNT(*) FROM metric_points WHERE run_id = :r"), {"r": run_id}).scalar()


@pytest.fixture
def env(database_url, tmp_path):
    """(sessionmaker, home, [two deletable runs]): cancelled runs, which deletion accepts."""
    api = make_client(database_url, tmp_path)
    run_ids = [r["id"] for r in create(api)["runs"]]
    factory = session_factory(database_url)
    with factory() as s:
        for rid in run_ids:
            runs.cancel_run(s, rid)
        s.commit()
    return factory, tmp_path, run_ids[:2]


def _in_thread(fn):
    out: dict = {}

    def go():
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=go)
    t.start()
    return t, out


def test_a_deletion_waits_for_an_ingest_in_flight_and_removes_its_points(env):
    factory, home, (run, other) = env
    with factory() as s:
        runs.ingest_metrics(s, other, _batch(0))
        s.commit()
    writer = factory()
    runs.ingest_metrics(writer, run, _batch(0))  # not committed: the run row is held FOR NO KEY UPDATE

    def delete():
        with factory() as s:
            housekeeping.delete_run(s, run, home)
            s.commit()

    t, out = _in_thread(delete)
    t.join(timeout=1.5)
    assert t.is_alive(), "the deletion should wait for the ingest's transaction"
    writer.commit()
    writer.close()
    t.join(timeout=60)
    assert not t.is_alive() and "error" not in out, out
    with factory() as s:
        assert _count(s, run) == 0 and _orphans(s) == (0, 0)
        assert _count(s, other) == 1000  # the other run's points are left alone


def test_an_ingest_behind_a_deletion_gets_404_and_stores_nothing(env):
    factory, home, (run, _) = env
    deleter = factory()
    housekeeping.delete_run(deleter, run, home)  # not committed: the run row is held FOR UPDATE

    def ingest():
        with factory() as s:
            result = runs.ingest_metrics(s, run, _batch(10_000))
            s.commit()
            return result

    t, out = _in_thread(ingest)
    t.join(timeout=1.5)
    assert t.is_alive(), "the ingest should wait for the deletion's transaction"
    deleter.commit()
    deleter.close()
    t.join(timeout=60)
    assert not t.is_alive() and isinstance(out.get("error"), NotFound), out
    with factory() as s:
        assert _count(s, run) == 0 and _orphans(s) == (0, 0)


def test_many_writers_racing_a_deletion_leave_no_orphan(env):
    """Free-running: writers keep sending batches while the run (and then its experiment) is deleted; every
    batch either lands before the deletion (and goes with it) or is refused with 404."""
    factory, home, (run, other) = env
    outcomes: list[str] = []

    def writer(w: int, rid: int) -> None:
        for b in range(500):  # until refused (bounded, so that a writer never refused cannot hang the test)
            with factory() as s:
                try:
                    runs.ingest_metrics(s, rid, _batch((w * 1000 + b) * 50, 50))
                    s.commit()
                    outcomes.append("ok")
                    # A pause between batches, as a training loop makes (with the FOR KEY SHARE lock ingest took
                    # until 2026-11-27, PostgreSQL let new writers past a waiting deletion, so writers that never
                    # paused held it off until they stopped).
                    time.sleep(0.02)
                except NotFound:
                    s.rollback()
                    outcomes.append("404")
                    return
                except Exception as e:  # noqa: BLE001 - a deadlock or any other failure fails the test
                    outcomes.append(f"{type(e).__name__}: {e}")
                    return

    threads = [threading.Thread(target=writer, args=(w, rid)) for w in range(4) for rid in (run, other)]
    for t in threads:
        t.start()
    while outcomes.count("ok") < 16:
        threading.Event().wait(0.01)
    with factory() as s:
        housekeeping.delete_run(s, run, home)
        s.commit()
    with factory() as s:
        exp = s.execute(sa.text("SELECT experiment_id FROM runs WHERE id = :r"), {"r": other}).scalar()
        housekeeping.delete_experiment(s, exp, home)
        s.commit()
    for t in threads:
        t.join(timeout=60)
    assert [o for o in outcomes if o != "ok"] == ["404"] * len(threads)  # each refused once its run was gone
    with factory() as s:
        assert _orphans(s) == (0, 0) and _count(s, run) == 0 and _count(s, other) == 0


def _columns_and_keys(url: str) -> tuple[list[str], list[str], int]:
    eng = sa.create_engine(url)
    try:
        insp = sa.inspect(eng)
        return ([c["name"] for c in insp.get_columns("metric_points")],
                insp.get_pk_constraint("metric_points")["constrained_columns"],
                len(insp.get_foreign_keys("metric_points")))
    finally:
        eng.dispose()


def test_the_migration_keeps_every_point_both_ways(database_url):
    upgrade(database_url, "0006")
    factory = session_factory(database_url)
    pts = [(s, 1.0 / (s + 1), 64 * s, 1.8e9 + s) for s in range(300)]
    with factory() as s:
        s.execute(sa.text("INSERT INTO experiments (id, name, description, model_config, data_config, "
                          "training_config, seed, recipes, baseline, eval_tasks, created_at) VALUES "
                          "(1, 'e', '', '{}', '{}', '{}', 0, '[]', 'bf16', '[]', '2026-01-01')"))
        s.execute(sa.text("INSERT INTO runs (id, experiment_id, recipe, recipe_options, bf16_first_layers, "
                          "bf16_last_layers, label, spec, external, status, cancel_requested, created_at, progress, "
                          "summary, conversion_report, attempts) VALUES (1, 1, 'bf16', '{}', 0, 0, '', '{}', "
                          "false, 'succeeded', false, '2026-01-01', '{}', '{}', '{}', 0)"))
        s.execute(sa.text("INSERT INTO metric_points (run_id, key, step, value, tokens, wall_time) "
                          "VALUES (1, :k, :s, :v, :t, :w)"),
                  [{"k": KEY, "s": st, "v": v, "t": t, "w": w} for st, v, t, w in pts])
        s.commit()

    def stored() -> list[tuple]:
        with factory() as s:
            return [tuple(r) for r in s.execute(sa.text(
                "SELECT step, value, tokens, wall_time FROM metric_points WHERE run_id = 1 ORDER BY step"))]

    assert _columns_and_keys(database_url) == (
        ["id", "run_id", "key", "step", "tokens", "wall_time", "value"], ["id"], 1)
    upgrade(database_url)
    assert _columns_and_keys(database_url) == (
        ["run_id", "key", "step", "tokens", "wall_time", "value"], ["run_id", "key", "step"], 0)
    assert stored() == pts
    with factory() as s:  # the unique key holds as the primary key: a re-sent batch stores nothing twice
        assert runs.ingest_metrics(s, 1, {KEY: pts[-10:] + [(300, 0.5, 0, 0.0)]}).inserted == 1
        s.commit()
    command.downgrade(alembic_config(database_url), "0006")
    columns, pk, fks = _columns_and_keys(database_url)
    assert (sorted(columns), pk, fks) == (sorted(["id", "run_id", "key", "step", "tokens", "wall_time", "value"]),
                                          ["id"], 1)
    assert stored() == pts + [(300, 0.5, 0, 0.0)]
    upgrade(database_url)
    assert stored() == pts + [(300, 0.5, 0, 0.0)]
