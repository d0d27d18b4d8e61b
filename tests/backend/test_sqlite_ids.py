"""On SQLite a deleted object's id is never handed out again (migration 0008): before it, deleting the newest run
and creating another gave the new run the deleted one's id, so a script still logging to the deleted run wrote into
the new one. The migration copies the tables (SQLite's only way to add AUTOINCREMENT): every row, every metric point
and every foreign key must come through, both ways."""
from __future__ import annotations

import sqlalchemy as sa
from alembic import command

from backend.db import session_factory
from backend.migrate import alembic_config, upgrade
from tests.backend.test_api import make_client

TABLES = ("experiments", "runs", "artifacts", "evaluations", "gemm_benchmarks", "api_tokens")


def _ddl(url: str) -> dict[str, str]:
    eng = sa.create_engine(url)
    try:
        with eng.connect() as c:
            return {name: sql for name, sql in c.exec_driver_sql("SELECT name, sql FROM sqlite_master "
                                                                "WHERE type = 'table'")}
    finally:
        eng.dispose()


def _snapshot(url: str) -> dict:
    eng = sa.create_engine(url)
    try:
        with eng.connect() as c:
            rows = {t: [tuple(r) for r in c.exec_driver_sql(f"SELECT * FROM {t} ORDER BY 1, 2")]
                    for t in (*TABLES, "eval_results", "metric_points", "metric_rollups")}
            fks = {t: sorted(tuple(r)[2:] for r in c.exec_driver_sql(f"PRAGMA foreign_key_list({t})"))
                   for t in (*TABLES, "eval_results", "metric_rollups")}
            return {"rows": rows, "fks": fks}
    finally:
        eng.dispose()


def test_the_migration_keeps_every_row_and_key_and_ids_are_never_reused(tmp_path):
    url = f"sqlite:///{tmp_path / 'plab.sqlite'}"
    upgrade(url, "0007")
    api = make_client(url, tmp_path)  # upgrades to head: go back to 0007 with data made through the API first
    exp = api.post("/api/v1/experiments", json={"name": "e", "model": "tiny", "data": {"corpus": "tinyshakespeare"},
                                               "training": {"steps": 30}, "recipes": ["fp8_tensorwise"],
                                               "enqueue": False}).json()
    run = exp["runs"][0]["id"]
    assert api.post(f"/api/v1/runs/{run}/metrics", json={"points": [
        {"key": "train/loss", "step": s, "tokens": 64 * s, "value": 1.0 / (s + 1)} for s in range(50)]}).status_code == 200
    assert api.post(f"/api/v1/runs/{run}/artifacts", json={"kind": "checkpoint", "path": "/tmp/x"}).status_code in (200, 201)
    api.close()
    command.downgrade(alembic_config(url), "0007")
    before = _snapshot(url)
    assert not any("AUTOINCREMENT" in sql for sql in _ddl(url).values())
    assert len(before["rows"]["metric_points"]) == 50 and before["rows"]["artifacts"]

    upgrade(url)
    ddl = _ddl(url)
    assert all("AUTOINCREMENT" in ddl[t] for t in TABLES), {t: ddl[t] for t in TABLES}
    assert _snapshot(url) == before   # every row and foreign key (with its ON DELETE) as it was
    command.downgrade(alembic_config(url), "0007")
    assert _snapshot(url) == before
    upgrade(url)

    # Deleting the newest run and experiment, then creating new ones: fresh ids, and a late batch for the deleted
    # run finds nothing to write into.
    api = make_client(url, tmp_path)
    mine = api.post("/api/v1/runs", json={"experiment_id": exp["id"], "recipe": "bf16", "label": "script A"}).json()
    assert api.delete(f"/api/v1/runs/{mine['id']}").status_code == 204
    other = api.post("/api/v1/runs", json={"experiment_id": exp["id"], "recipe": "bf16", "label": "script B"}).json()
    assert other["id"] > mine["id"]
    late = api.post(f"/api/v1/runs/{mine['id']}/metrics", json={"points": [{"key": "train/loss", "step": 2,
                                                                            "value": 99.0}]})
    assert late.status_code == 404
    assert api.get(f"/api/v1/runs/{other['id']}/metrics/train/loss").json()["value"] == []
    # the experiment cascade still reaches runs, points and artifacts through the copied foreign keys
    for r in api.get(f"/api/v1/experiments/{exp['id']}").json()["runs"]:
        done = (api.post(f"/api/v1/runs/{r['id']}/status", json={"status": "succeeded"}) if r["status"] == "running"
                else api.post(f"/api/v1/runs/{r['id']}/cancel"))
        assert done.status_code == 200, done.text
    r = api.delete(f"/api/v1/experiments/{exp['id']}")
    assert r.status_code == 204, r.text
    with session_factory(url)() as s:
        assert s.execute(sa.text("SELECT COUNT(*) FROM runs")).scalar() == 0
        assert s.execute(sa.text("SELECT COUNT(*) FROM artifacts")).scalar() == 0
    again = api.post("/api/v1/experiments", json={"name": "e2", "model": "tiny", "data": {"corpus": "tinyshakespeare"},
                                                 "training": {"steps": 30}, "recipes": ["bf16"], "enqueue": False}).json()
    assert again["id"] > exp["id"] and min(r["id"] for r in again["runs"]) > other["id"]


def test_downgrades_after_0008_keep_autoincrement_and_the_ids_deleted_stay_used(tmp_path):
    """The downgrades of 0011-0015 dropped their columns with alembic's batch mode, which on SQLite copies the table
    without AUTOINCREMENT: after a downgrade (and the upgrade back) a deleted evaluation's or benchmark's id was
    handed out again. They now drop in place (backend.migrations.ddl)."""
    url = f"sqlite:///{tmp_path / 'plab.sqlite'}"
    api = make_client(url, tmp_path)
    exp = api.post("/api/v1/experiments", json={"name": "e", "model": "tiny", "data": {"corpus": "tinyshakespeare"},
                                               "training": {"steps": 30}, "recipes": ["bf16"],
                                               "enqueue": False}).json()
    rid = exp["runs"][0]["id"]
    api.close()
    rows = {"evaluations": ("(run_id, tasks, status, created_at)",
                            f"({rid}, '[\"plab_piqa\"]', 'succeeded', CURRENT_TIMESTAMP)"),
            "gemm_benchmarks": ("(name, request, status, result, created_at)",
                                "('b', '{}', 'queued', '{}', CURRENT_TIMESTAMP)")}

    def add(table) -> int:
        with session_factory(url)() as s:
            columns, values = rows[table]
            s.execute(sa.text(f"INSERT INTO {table} {columns} VALUES {values}"))
            s.commit()
            return s.execute(sa.text(f"SELECT MAX(id) FROM {table}")).scalar()

    deleted = {}
    for table in rows:  # two of each, the newest deleted
        add(table)
        deleted[table] = add(table)
        with session_factory(url)() as s:
            s.execute(sa.text(f"DELETE FROM {table} WHERE id = :i"), {"i": deleted[table]})
            s.commit()
    before = _snapshot(url)["rows"]

    command.downgrade(alembic_config(url), "0010")
    ddl = _ddl(url)
    assert all("AUTOINCREMENT" in ddl[t] for t in TABLES), {t: ddl[t] for t in TABLES}
    assert "heartbeat_at" not in ddl["evaluations"] and "dispatch_id" not in ddl["gemm_benchmarks"]
    upgrade(url)
    assert "worker_host" in _ddl(url)["evaluations"]
    after = _snapshot(url)["rows"]
    assert {t: len(after[t]) for t in TABLES} == {t: len(before[t]) for t in TABLES}
    assert {table: add(table) for table in rows} == {table: deleted[table] + 1 for table in rows}
