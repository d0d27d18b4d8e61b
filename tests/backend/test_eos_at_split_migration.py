"""Migration 0010: specs stored before data.eos_at_split existed keep the tokens they ran with (false), new
experiments get true; a downgrade gives the code before it specs it can read, on SQLite and on the real PostgreSQL."""
from __future__ import annotations

from alembic import command

from backend.migrate import alembic_config, upgrade
from tests.backend.test_api import create, make_client
from tests.backend.test_val_windows_migration import _specs, _strip_key
from training.config import RunSpec


def test_stored_specs_get_false_new_ones_true_and_a_downgrade_keeps_what_old_code_can_read(database_url, tmp_path):
    api = make_client(database_url, tmp_path)
    old = create(api, name="stored before")                                        # its specs lose the key below
    named = create(api, name="said false", data={"corpus": "tinyshakespeare", "eos_at_split": False})
    new_rule = create(api, name="said true", data={"corpus": "tinyshakespeare", "eos_at_split": True})
    external = api.post("/api/v1/runs", json={"experiment_id": old["id"], "recipe": "bf16", "label": "theirs"}).json()
    api.close()
    old_runs = [r["id"] for r in old["runs"]]
    runs, _ = _specs(database_url)
    assert {runs[r]["data"]["eos_at_split"] for r in old_runs} == {True}   # today's default, written out

    command.downgrade(alembic_config(database_url), "0009")
    runs, exps = _specs(database_url)
    assert all("eos_at_split" not in runs[r["id"]]["data"] for r in named["runs"])  # false is what 0009 ran
    assert "eos_at_split" not in exps[named["id"]]
    assert all(runs[r["id"]]["data"]["eos_at_split"] is True for r in new_rule["runs"])  # kept: 0009 refuses it
    assert all(runs[r["id"]]["data"]["val_windows"] == "spread" for r in named["runs"])  # 0009's key untouched
    _strip_key(database_url, old_runs, "eos_at_split")
    before = _specs(database_url)

    upgrade(database_url)
    runs, exps = _specs(database_url)
    for r in old_runs + [r["id"] for r in named["runs"]]:
        assert runs[r]["data"]["eos_at_split"] is False, runs[r]
        assert RunSpec.from_dict(runs[r], check_paths=False).data.eos_at_split is False
        assert {**runs[r], "data": {k: v for k, v in runs[r]["data"].items() if k != "eos_at_split"}} == before[0][r]
    assert exps[old["id"]] == {"corpus": "tinyshakespeare", "eos_at_split": False}
    assert exps[named["id"]] == {"corpus": "tinyshakespeare", "eos_at_split": False}
    assert all(runs[r["id"]] == before[0][r["id"]] for r in new_rule["runs"])
    assert exps[new_rule["id"]] == before[1][new_rule["id"]]
    assert runs[external["id"]] == before[0][external["id"]] and "data" not in runs[external["id"]]

    api = make_client(database_url, tmp_path)
    new = create(api, name="after")
    api.close()
    runs, exps = _specs(database_url)
    assert {runs[r["id"]]["data"]["eos_at_split"] for r in new["runs"]} == {True}
    assert "eos_at_split" not in exps[new["id"]]  # the user's words, as given
