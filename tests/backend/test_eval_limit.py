"""An evaluation's `limit`, as lm-eval's --limit: a whole number of documents per task or a fraction of each task's
documents in (0, 1), through the API on SQLite and the real PostgreSQL, and migration 0014, which made the column a
float, keeping every stored limit (a downgrade refuses while a fractional one is stored)."""
from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic import command

from backend.migrate import alembic_config, upgrade
from backend.models import Artifact
from tests.backend.test_api import EXPERIMENT, make_client

MESSAGE = "limit must be a whole number of documents per task (1 to 1,000,000) or a fraction of each task's documents"


def _finished_run(api) -> int:
    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"]}).json()
    rid = exp["runs"][0]["id"]
    with api.app.state.sessionmaker() as s:
        s.add(Artifact(run_id=rid, kind="checkpoint", path="/checkpoints/final", step=20))
        s.commit()
    for status in ("running", "succeeded"):
        assert api.post(f"/api/v1/runs/{rid}/status", json={"status": status}).status_code == 200
    return rid


@pytest.mark.parametrize("given, stored", [(0.25, 0.25), (5, 5), (5.0, 5), (1_000_000, 1_000_000), (None, None)])
def test_a_fraction_or_a_whole_number_is_stored_and_sent_to_the_worker_as_given(database_url, tmp_path, given, stored):
    api = make_client(database_url, tmp_path)
    rid = _finished_run(api)
    r = api.post(f"/api/v1/runs/{rid}/evaluations", json={"tasks": ["plab_piqa"], "limit": given})
    assert r.status_code == 201, r.text
    eid = r.json()["id"]
    for body in (r.json(), api.get(f"/api/v1/evaluations/{eid}").json(),
                 api.get(f"/api/v1/evaluations/{eid}/job").json(), api.get(f"/api/v1/runs/{rid}/evaluations").json()[0]):
        assert body["limit"] == stored and type(body["limit"]) is type(stored), body  # 5 stays an integer


@pytest.mark.parametrize("given", [0, -1, 1.5, 1_000_001, 1e300, True, "0.5", [1], {"n": 1}])
def test_any_other_limit_is_refused_with_what_a_limit_may_be(database_url, tmp_path, given):
    api = make_client(database_url, tmp_path)
    rid = _finished_run(api)
    r = api.post(f"/api/v1/runs/{rid}/evaluations", json={"tasks": ["plab_piqa"], "limit": given})
    assert r.status_code == 422 and MESSAGE in r.text, r.text
    assert api.get(f"/api/v1/runs/{rid}/evaluations").json() == []


def _limits(database_url) -> dict:
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as c:
            return dict(c.execute(sa.text('SELECT id, "limit" FROM evaluations ORDER BY id')).all())
    finally:
        engine.dispose()


def test_migration_0014_keeps_stored_limits_and_a_downgrade_refuses_to_round_a_fraction(database_url, tmp_path):
    api = make_client(database_url, tmp_path)
    rid = _finished_run(api)
    api.close()
    command.downgrade(alembic_config(database_url), "0013")  # the integer column, as before this change
    engine = sa.create_engine(database_url)
    with engine.begin() as c:
        for limit in (7, None):
            c.execute(sa.text('INSERT INTO evaluations (run_id, tasks, "limit", status, created_at) '
                              "VALUES (:r, :t, :l, 'succeeded', CURRENT_TIMESTAMP)"),
                      {"r": rid, "t": '["plab_piqa"]', "l": limit})
    engine.dispose()
    old = _limits(database_url)
    assert sorted(old.values(), key=str) == [7, None]

    upgrade(database_url)
    api = make_client(database_url, tmp_path)
    assert [e["limit"] for e in api.get(f"/api/v1/runs/{rid}/evaluations").json()] == [old[k] for k in sorted(old)]
    frac = api.post(f"/api/v1/runs/{rid}/evaluations", json={"tasks": ["plab_piqa"], "limit": 0.1}).json()["id"]
    api.close()

    with pytest.raises(RuntimeError, match=rf"evaluation\(s\) \[{frac}\] have a fractional limit"):
        command.downgrade(alembic_config(database_url), "0013")
    assert _limits(database_url) == {**old, frac: 0.1}  # nothing changed by the refused downgrade
    engine = sa.create_engine(database_url)
    with engine.begin() as c:
        c.execute(sa.text("DELETE FROM evaluations WHERE id = :i"), {"i": frac})
    engine.dispose()
    command.downgrade(alembic_config(database_url), "0013")
    assert _limits(database_url) == old and all(v is None or type(v) is int for v in old.values())
    upgrade(database_url)
    if database_url.startswith("sqlite"):  # the column is not copied: the table keeps AUTOINCREMENT (0008)
        engine = sa.create_engine(database_url)
        with engine.connect() as c:
            ddl = c.execute(sa.text("SELECT sql FROM sqlite_master WHERE name = 'evaluations'")).scalar()
        engine.dispose()
        assert "AUTOINCREMENT" in ddl, ddl
