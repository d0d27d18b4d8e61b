"""Housekeeping through the API: names, tags, notes, search, archive (hidden by default, restorable) and delete
(metrics and files go too; writes need a write-scope token), checkpoint download confined to the run's folder,
and the full-resolution export."""
from __future__ import annotations

import csv
import io
import json
import os
import tarfile

import pytest
from fastapi.testclient import TestClient

from backend.app import create_app
from backend.migrate import upgrade
from plab.settings import Settings

ADMIN = "housekeeping-admin-token"
EXPERIMENT = {"name": "fp8 on tiny", "model": "tiny", "data": {"corpus": "tinyshakespeare"},
              "training": {"steps": 20}, "recipes": ["fp8_tensorwise"], "enqueue": False}


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def api(database_url, tmp_path):
    upgrade(database_url)
    settings = Settings(home=tmp_path, database_url=database_url, broker_url="filesystem://", api_token=ADMIN,
                        data_dir=tmp_path, api_url="http://test")
    client = TestClient(create_app(settings, migrate=False))
    client.home = tmp_path
    return client


def _create(api, **over) -> dict:
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, **over}, headers=_bearer(ADMIN))
    assert r.status_code == 201, r.text
    return r.json()


def _names(api, **params) -> list[str]:
    r = api.get("/api/v1/experiments", params=params)
    assert r.status_code == 200, r.text
    return [e["name"] for e in r.json()["items"]]


def test_tags_notes_names_and_search_by_name_tag_recipe_and_model(api):
    a = _create(api)
    _create(api, name="nvfp4 sweep", recipes=["nvfp4"], model={"hidden_size": 64, "num_hidden_layers": 2,
                                                                "num_attention_heads": 2, "intermediate_size": 128})
    r = api.patch(f"/api/v1/experiments/{a['id']}", headers=_bearer(ADMIN), json={
        "name": "fp8 first try", "description": "**why**: check FP8", "tags": ["Baseline-check", "h100 ", "h100"],
        "notes": "loss spikes at step 30"})
    assert r.status_code == 200, r.text
    got = api.get(f"/api/v1/experiments/{a['id']}").json()
    assert (got["name"], got["description"], got["notes"]) == ("fp8 first try", "**why**: check FP8",
                                                              "loss spikes at step 30")
    assert got["tags"] == ["Baseline-check", "h100"]  # trailing blank dropped, repeats once
    assert _names(api, tag="h100") == ["fp8 first try"]
    assert _names(api, tag="h10") == []  # a tag matches whole, not as a prefix
    assert _names(api, q="baseline") == ["fp8 first try"]   # by tag text
    assert _names(api, q="nvfp4") == ["nvfp4 sweep"]         # by recipe
    assert _names(api, q="hidden_size") == ["nvfp4 sweep"]   # by model
    assert _names(api, q="tiny") == ["fp8 first try"]        # by preset
    assert _names(api, q="100%_") == []                      # LIKE wildcards are literal
    for bad in ({"tags": ["a,b"]}, {"tags": [" lead"]}, {"tags": ["x" * 65]}, {"name": ""}, {"colour": "red"},
                {"notes": "x" * 20_001}):
        r = api.patch(f"/api/v1/experiments/{a['id']}", headers=_bearer(ADMIN), json=bad)
        assert r.status_code == 422, (bad, r.text)
        assert isinstance(r.json()["detail"], str)
    run = a["runs"][1]
    r = api.patch(f"/api/v1/runs/{run['id']}", headers=_bearer(ADMIN),
                  json={"label": "fp8 (retry)", "tags": ["keep"], "notes": "n"})
    assert r.status_code == 200 and r.json()["label"] == "fp8 (retry)" and r.json()["tags"] == ["keep"]
    listed = api.get("/api/v1/runs", params={"tag": "keep"}).json()
    assert [x["id"] for x in listed["items"]] == [run["id"]]
    assert api.get("/api/v1/runs", params={"q": "retry"}).json()["total"] == 1


def test_archived_experiments_and_runs_are_hidden_by_default_and_restorable(api):
    a, b = _create(api, name="old"), _create(api, name="new")
    assert api.patch(f"/api/v1/experiments/{a['id']}", json={"archived": True}, headers=_bearer(ADMIN)).json()[
        "archived_at"] is not None
    assert _names(api) == ["new"]
    assert _names(api, archived=True) == ["old"]
    # The runs of an archived experiment leave the runs list with it; an archived run alone too.
    api.patch(f"/api/v1/runs/{b['runs'][0]['id']}", json={"archived": True}, headers=_bearer(ADMIN))
    visible = {r["id"] for r in api.get("/api/v1/runs").json()["items"]}
    assert visible == {b["runs"][1]["id"]}
    archived = {r["id"] for r in api.get("/api/v1/runs", params={"archived": True}).json()["items"]}
    assert archived == {r["id"] for r in a["runs"]} | {b["runs"][0]["id"]}
    # Archived objects still open by id (links keep working).
    assert api.get(f"/api/v1/experiments/{a['id']}").status_code == 200
    api.patch(f"/api/v1/experiments/{a['id']}", json={"archived": False}, headers=_bearer(ADMIN))
    assert sorted(_names(api)) == ["new", "old"]


def _points(n: int, key: str = "train/loss") -> dict:
    return {"points": [{"key": key, "step": s, "value": 1.0 / (s + 1), "tokens": 64 * s} for s in range(n)]}


def test_deleting_a_record_only_run_leaves_a_folder_of_that_id_without_run_json(api):
    """A record-only run trains in its owner's script and never writes PLAB_HOME/runs/<id>: files there that name no
    run (another database's, from before run.json) are not its to delete, whatever its start time says."""
    exp = _create(api)
    rec = api.post("/api/v1/runs", json={"experiment_id": exp["id"], "recipe": "bf16", "external": True},
                   headers=_bearer(ADMIN)).json()
    for status in ("running", "succeeded"):
        api.post(f"/api/v1/runs/{rec['id']}/status", json={"status": status}, headers=_bearer(ADMIN))
    foreign = api.home / "runs" / str(rec["id"]) / "checkpoints"
    foreign.mkdir(parents=True)
    assert api.delete(f"/api/v1/runs/{rec['id']}", headers=_bearer(ADMIN)).status_code == 204
    assert foreign.exists()


def test_delete_needs_a_write_token_and_removes_metrics_and_files(api):
    read = api.post("/api/v1/tokens", json={"name": "reader", "scope": "read"}, headers=_bearer(ADMIN)).json()
    write = api.post("/api/v1/tokens", json={"name": "writer", "scope": "write"}, headers=_bearer(ADMIN)).json()
    exp = _create(api)
    base, other = exp["runs"]
    for run in exp["runs"]:
        assert api.post(f"/api/v1/runs/{run['id']}/metrics", json=_points(50), headers=_bearer(ADMIN)).status_code == 200
    from plab import run_folder

    folder = api.home / "runs" / str(other["id"])
    run_folder.claim(api.home, run_folder.identity(other["id"], exp["id"], other["created_at"]),
                     started_before=False)  # as a worker does before it trains the run
    (folder / "checkpoints" / "step_00000010").mkdir(parents=True)
    # runs/<base> holds another database's run of that id (PLAB_HOME outlived a database): never this run's to delete
    foreign = api.home / "runs" / str(base["id"])
    (foreign / "checkpoints").mkdir(parents=True)
    (foreign / "run.json").write_text(json.dumps(run_folder.identity(base["id"], 999, "2026-01-01T00:00:00+00:00")))
    (folder / "checkpoints" / "step_00000010" / "model.safetensors").write_bytes(b"w" * 100)

    # Queued runs are live: deleting them would orphan a worker's job.
    r = api.delete(f"/api/v1/runs/{other['id']}", headers=_bearer(write["token"]))
    assert r.status_code == 409 and "cancel" in r.json()["detail"]
    for run in exp["runs"]:
        assert api.post(f"/api/v1/runs/{run['id']}/cancel", headers=_bearer(ADMIN)).status_code == 200

    assert api.delete(f"/api/v1/runs/{other['id']}").status_code == 401
    r = api.delete(f"/api/v1/runs/{other['id']}", headers=_bearer(read["token"]))
    assert r.status_code == 403 and "read" in r.json()["detail"]
    assert api.patch(f"/api/v1/runs/{other['id']}", json={"tags": ["x"]},
                     headers=_bearer(read["token"])).status_code == 403
    assert api.get(f"/api/v1/runs/{other['id']}").status_code == 200 and folder.exists()

    # An evaluation still running on the run (stored as a worker's job would leave it): a worker would write into it.
    from backend.models import Evaluation

    with api.app.state.sessionmaker() as session:
        ev = Evaluation(run_id=other["id"], tasks=["plab_piqa"], status="running")
        session.add(ev)
        session.commit()
        ev_id = ev.id
    r = api.delete(f"/api/v1/runs/{other['id']}", headers=_bearer(write["token"]))
    assert r.status_code == 409 and "evaluations" in r.json()["detail"] and str(ev_id) in r.json()["detail"]
    # the way out the message names, with the same token
    assert 'POST /api/v1/evaluations/<id>/status {"status": "failed"}' in r.json()["detail"]
    r = api.post(f"/api/v1/evaluations/{ev_id}/status", json={"status": "failed"}, headers=_bearer(write["token"]))
    assert r.status_code == 200, r.text
    assert api.delete(f"/api/v1/runs/{other['id']}", headers=_bearer(write["token"])).status_code == 204
    assert api.get(f"/api/v1/runs/{other['id']}").status_code == 404
    assert api.get(f"/api/v1/runs/{other['id']}/metrics/train/loss").status_code == 404
    assert not folder.exists()
    keys = api.get(f"/api/v1/experiments/{exp['id']}/metrics").json()["keys"]
    assert keys == [{"key": "train/loss", "runs": 1, "points": 50}]  # the deleted run's points are gone

    assert api.delete(f"/api/v1/experiments/{exp['id']}", headers=_bearer(write["token"])).status_code == 204
    assert api.get(f"/api/v1/experiments/{exp['id']}").status_code == 404
    assert api.get(f"/api/v1/runs/{base['id']}").status_code == 404
    assert (foreign / "checkpoints").exists()
    assert api.delete(f"/api/v1/experiments/{exp['id']}", headers=_bearer(write["token"])).status_code == 404


def test_checkpoint_download_streams_the_folder_and_never_leaves_the_run_folder(api, tmp_path_factory):
    exp = _create(api)
    run_id, other_id = exp["runs"][1]["id"], exp["runs"][0]["id"]
    ckpt = api.home / "runs" / str(run_id) / "checkpoints" / "step_00000020"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text('{"hidden_size": 64}')
    (ckpt / "model.safetensors").write_bytes(os.urandom(3000))
    secret = tmp_path_factory.mktemp("outside") / "secret.txt"
    secret.write_text("not yours")
    (ckpt / "leak.txt").symlink_to(secret)             # a link inside the checkpoint pointing out
    (api.home / "runs" / str(other_id)).mkdir(parents=True)
    (api.home / "runs" / str(other_id) / "theirs.bin").write_bytes(b"other run")

    def add(path: str) -> int:
        r = api.post(f"/api/v1/runs/{run_id}/artifacts", json={"kind": "checkpoint", "path": path, "step": 20},
                     headers=_bearer(ADMIN))
        assert r.status_code == 201, r.text
        return r.json()["id"]

    good = add(f"runs/{run_id}/checkpoints/step_00000020")
    r = api.get(f"/api/v1/runs/{run_id}/artifacts/{good}/download")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = sorted(tar.getnames())
        assert names == ["step_00000020/config.json", "step_00000020/model.safetensors"]
        assert tar.extractfile("step_00000020/model.safetensors").read() == (ckpt / "model.safetensors").read_bytes()
    one = add(f"runs/{run_id}/checkpoints/step_00000020/config.json")
    r = api.get(f"/api/v1/runs/{run_id}/artifacts/{one}/download")
    assert r.status_code == 200 and r.json() == {"hidden_size": 64}

    for escape in (str(secret), f"runs/{run_id}/../{other_id}/theirs.bin", "../../etc/passwd",
                   f"runs/{run_id}/checkpoints/step_00000020/leak.txt", f"runs/{other_id}"):
        target = add(escape)
        r = api.get(f"/api/v1/runs/{run_id}/artifacts/{target}/download")
        assert r.status_code in (403, 404), (escape, r.status_code)
        assert "not yours" not in r.text and "other run" not in r.text
        if escape != "../../etc/passwd" or os.path.exists(api.home / "../../etc/passwd"):
            assert r.status_code == 403 and "outside run" in r.json()["detail"], (escape, r.text)
    # An artifact id of another run, or an id that does not exist, is a 404.
    assert api.get(f"/api/v1/runs/{other_id}/artifacts/{good}/download").status_code == 404
    assert api.get(f"/api/v1/runs/{run_id}/artifacts/999999/download").status_code == 404
    gone = add(f"runs/{run_id}/checkpoints/step_00000010")
    r = api.get(f"/api/v1/runs/{run_id}/artifacts/{gone}/download")
    assert r.status_code == 404 and "no longer on disk" in r.json()["detail"]


def test_export_streams_every_point_at_full_resolution(api):
    exp = _create(api)
    base, other = exp["runs"]
    api.post(f"/api/v1/runs/{base['id']}/metrics", json=_points(5000), headers=_bearer(ADMIN))
    api.post(f"/api/v1/runs/{base['id']}/metrics", json=_points(300, "train/grad_norm"), headers=_bearer(ADMIN))
    api.post(f"/api/v1/runs/{other['id']}/metrics", json=_points(4000), headers=_bearer(ADMIN))
    r = api.get(f"/api/v1/experiments/{exp['id']}/export", params={"format": "csv"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert len(rows) == 5000 + 300 + 4000
    assert rows[0] == {"run_id": str(base["id"]), "recipe": "bf16", "label": "bf16", "key": "train/grad_norm",
                       "step": "0", "tokens": "0", "wall_time": "", "value": "1.0", "gemm_backend": ""}
    only = api.get(f"/api/v1/experiments/{exp['id']}/export", params={"format": "csv", "keys": "train/grad_norm"})
    assert len(only.text.strip().splitlines()) == 301
    data = json.loads(api.get(f"/api/v1/experiments/{exp['id']}/export", params={"format": "json"}).text)
    assert [r["run_id"] for r in data["runs"]] == [base["id"], other["id"]]
    assert len(data["runs"][0]["series"]["train/loss"]["step"]) == 5000
    assert data["runs"][1]["series"]["train/loss"]["value"][-1] == pytest.approx(1 / 4000)
    # A run without points is listed with no series.
    third = api.post("/api/v1/runs", json={"experiment_id": exp["id"], "recipe": "mxfp8"}, headers=_bearer(ADMIN))
    data = json.loads(api.get(f"/api/v1/experiments/{exp['id']}/export", params={"format": "json"}).text)
    assert data["runs"][-1] == {"run_id": third.json()["id"], "recipe": "mxfp8", "label": "mxfp8 (external)",
                                "status": "running", "gemm_backend": None, "series": {}}
    assert api.get("/api/v1/experiments/999999/export").status_code == 404
