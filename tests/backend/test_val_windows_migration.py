"""Migration 0009: specs stored before data.val_windows existed keep validating on the first windows (what they ran
with), new experiments get "spread"; a downgrade gives the code before it specs it can read, on SQLite and on the
real PostgreSQL."""
from __future__ import annotations

import sqlalchemy as sa
from alembic import command

from backend.migrate import alembic_config, upgrade
from tests.backend.test_api import create, make_client
from training.config import RunSpec


def _specs(url: str) -> tuple[dict[int, dict], dict[int, dict]]:
    eng = sa.create_engine(url)
    runs = sa.table("runs", sa.column("id"), sa.column("spec", sa.JSON))
    exps = sa.table("experiments", sa.column("id"), sa.column("data_config", sa.JSON))
    try:
        with eng.connect() as c:
            return (dict(c.execute(sa.select(runs.c.id, runs.c.spec)).all()),
                    dict(c.execute(sa.select(exps.c.id, exps.c.data_config)).all()))
    finally:
        eng.dispose()


def _strip_key(url: str, run_ids: list[int], key: str = "val_windows") -> None:
    """What a spec stored before the key existed looks like: the same spec without it."""
    eng = sa.create_engine(url)
    runs = sa.table("runs", sa.column("id"), sa.column("spec", sa.JSON))
    try:
        with eng.begin() as c:
            for run_id, spec in c.execute(sa.select(runs.c.id, runs.c.spec).where(runs.c.id.in_(run_ids))).all():
                data = {k: v for k, v in spec["data"].items() if k != key}
                c.execute(runs.update().where(runs.c.id == run_id).values(spec={**spec, "data": data}))
    finally:
        eng.dispose()


def test_stored_specs_get_first_new_ones_spread_and_a_downgrade_keeps_what_old_code_can_read(database_url, tmp_path):
    api = make_client(database_url, tmp_path)
    old = create(api, name="stored before")                                        # its specs lose the key below
    named = create(api, name="said first", data={"corpus": "tinyshakespeare", "val_windows": "first"})
    spread = create(api, name="said spread", data={"corpus": "tinyshakespeare", "val_windows": "spread"})
    external = api.post("/api/v1/runs", json={"experiment_id": old["id"], "recipe": "bf16", "label": "theirs"}).json()
    api.close()
    old_runs = [r["id"] for r in old["runs"]]
    runs, _ = _specs(database_url)
    assert {runs[r]["data"]["val_windows"] for r in old_runs} == {"spread"}   # today's default, written out

    command.downgrade(alembic_config(database_url), "0008")
    runs, exps = _specs(database_url)
    assert all("val_windows" not in runs[r["id"]]["data"] for r in named["runs"])  # "first" is what 0008 ran
    assert "val_windows" not in exps[named["id"]]
    assert all(runs[r["id"]]["data"]["val_windows"] == "spread" for r in spread["runs"])  # kept: 0008 refuses it
    _strip_key(database_url, old_runs)
    before = _specs(database_url)

    upgrade(database_url)
    runs, exps = _specs(database_url)
    for r in old_runs + [r["id"] for r in named["runs"]]:
        assert runs[r]["data"]["val_windows"] == "first", runs[r]
        assert RunSpec.from_dict(runs[r], check_paths=False).data.val_windows == "first"
        assert {**runs[r], "data": {k: v for k, v in runs[r]["data"].items() if k != "val_windows"}} == before[0][r]
    assert exps[old["id"]] == {"corpus": "tinyshakespeare", "val_windows": "first"}
    assert exps[named["id"]] == {"corpus": "tinyshakespeare", "val_windows": "first"}
    assert all(runs[r["id"]] == before[0][r["id"]] for r in spread["runs"])
    assert exps[spread["id"]] == before[1][spread["id"]]
    assert runs[external["id"]] == before[0][external["id"]] and "data" not in runs[external["id"]]

    api = make_client(database_url, tmp_path)
    new = create(api, name="after")
    api.close()
    runs, exps = _specs(database_url)
    assert {runs[r["id"]]["data"]["val_windows"] for r in new["runs"]} == {"spread"}
    assert "val_windows" not in exps[new["id"]]  # the user's words, as given
