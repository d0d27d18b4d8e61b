"""The REST API against real databases (a SQLite file and the machine's PostgreSQL)."""
from __future__ import annotations

import math
import os

import pytest
from fastapi.testclient import TestClient

from backend.app import create_app
from backend.migrate import upgrade
from plab.settings import Settings


def make_client(database_url, tmp_path, token=None) -> TestClient:
    upgrade(database_url)
    settings = Settings(home=tmp_path, database_url=database_url, broker_url="filesystem://", api_token=token,
                        data_dir=tmp_path, api_url="http://test")
    return TestClient(create_app(settings, migrate=False))


@pytest.fixture
def api(database_url, tmp_path):
    return make_client(database_url, tmp_path)


EXPERIMENT = {"name": "fp8 vs bf16", "model": "tiny", "data": {"corpus": "tinyshakespeare"},
              "training": {"steps": 20}, "recipes": ["fp8_tensorwise", {"name": "nvfp4", "bf16_last_layers": 1}],
              "enqueue": False}


def create(api, **over) -> dict:
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, **over})
    assert r.status_code == 201, r.text
    return r.json()


def test_creating_an_experiment_makes_one_queued_run_per_recipe_with_bf16_as_baseline(api):
    exp = create(api)
    assert [r["recipe"] for r in exp["runs"]] == ["bf16", "fp8_tensorwise", "nvfp4"]
    assert all(r["status"] == "queued" for r in exp["runs"])
    nvfp4 = exp["runs"][2]
    assert nvfp4["bf16_last_layers"] == 1 and "bf16_last=1" in nvfp4["label"]
    detail = api.get(f"/api/v1/runs/{nvfp4['id']}").json()
    assert detail["spec"]["recipe"] == "nvfp4" and detail["spec"]["bf16_last_layers"] == 1
    assert detail["spec"]["training"]["steps"] == 20
    listed = api.get("/api/v1/experiments").json()
    assert listed["total"] == 1 and listed["items"][0]["id"] == exp["id"]


def test_a_recipe_given_twice_is_one_recipe_and_coinciding_labels_stay_apart(api):
    exp = create(api, recipes=["bf16", {"name": "bf16"}, "nvfp4", {"name": "fp8_tensorwise", "label": "nvfp4"}])
    assert [(r["recipe"], r["label"]) for r in exp["runs"]] == [("bf16", "bf16"), ("nvfp4", "nvfp4"),
                                                                ("fp8_tensorwise", "nvfp4 #2")]


@pytest.mark.parametrize("body, fragment", [
    ({"recipes": ["fp9"]}, "unknown recipe 'fp9'"),
    ({"training": {"steps": -5}}, "steps"),
    ({"training": {"stepz": 5}}, "stepz"),
    ({"model": "7b"}, "7b"),
    ({"name": ""}, "name"),
    ({"colour": "red"}, "colour"),
])
def test_bad_experiments_are_refused_with_a_message_naming_the_problem(api, body, fragment):
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, **body})
    assert r.status_code == 422, r.text
    assert fragment in r.json()["detail"]
    assert api.get("/api/v1/experiments").json()["total"] == 0  # nothing half-stored


@pytest.mark.parametrize("body, detail", [
    # a recipe object breaking RecipeRequest's rules: no "recipes.1.str: Input should be a valid string" beside it
    ({"recipes": ["bf16", {"name": "nvfp4", "keep_bf16": [""]}]},
     "recipes.1.keep_bf16.0: String should have at least 1 character"),
    ({"recipes": ["bf16", {"name": "nvfp4", "rht": True}]}, "recipes.1.rht: Extra inputs are not permitted"),
    ({"recipes": ["bf16", {"name": "fp9"}]}, "recipes.1: unknown recipe 'fp9'; choose one of bf16, fp8_delayed, "
     "fp8_tensorwise, fp8_rowwise, fp8_blockwise, mxfp8, nvfp4"),
    # a value of neither member's type: one line saying what it may be; other fields' errors kept, in order
    ({"name": 5, "model": 5, "recipes": [7]},
     "name: Input should be a valid string; model: Input should be a valid string | Input should be a valid "
     "dictionary; recipes.0: Input should be a valid string | Input should be a valid dictionary or object to "
     "extract fields from"),
])
def test_a_unions_error_names_the_member_the_value_was_meant_as(api, body, detail):
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, **body})
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == detail
    assert len(r.json()["errors"]) > 1  # the structured list keeps every member's error


def test_a_corpus_typo_is_refused_at_submission_where_the_api_holds_the_data(api, monkeypatch, tmp_path):
    typo = {**EXPERIMENT, "data": {"corpus": "tinyshakespear"}}
    r = api.post("/api/v1/experiments", json=typo)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert detail.startswith("the run spec of recipe bf16: data.corpus ")  # the baseline, which the experiment adds first
    assert detail.endswith("does not exist; give a name under PLAB_DATA_DIR (a relative path is read from there, not "
                           "from the current folder), an absolute path or a glob (data directory: "
                           f"{os.environ['PLAB_DATA_DIR']}); did you mean tinyshakespeare?")
    init = {**EXPERIMENT, "model": {"init_from": "tinyshakespeare"}}
    assert "is not a Hugging Face checkpoint folder" in api.post("/api/v1/experiments", json=init).json()["detail"]
    assert api.get("/api/v1/experiments").json()["total"] == 0
    # An API host without the data directory (the workers hold it) stores the spec; the worker checks it.
    monkeypatch.setenv("PLAB_DATA_DIR", str(tmp_path / "not-on-this-host"))
    assert api.post("/api/v1/experiments", json=typo).status_code == 201


def test_metric_batches_are_idempotent_on_run_key_step(api):
    run = create(api)["runs"][0]
    points = [{"key": "train/loss", "step": s, "value": 5.0 - s / 100, "tokens": s * 1024, "wall_time": s * 0.1}
              for s in range(500)]
    first = api.post(f"/api/v1/runs/{run['id']}/metrics", json={"points": points}).json()
    assert (first["inserted"], first["duplicates"]) == (500, 0)
    again = api.post(f"/api/v1/runs/{run['id']}/metrics", json={"points": points}).json()
    assert (again["inserted"], again["duplicates"]) == (0, 500)
    series = api.get(f"/api/v1/runs/{run['id']}/metrics/train/loss?max_points=1000").json()
    assert series["step"] == list(range(500)) and series["total_points"] == 500
    assert series["value"][0] == 5.0 and not series["downsampled"]
    assert api.get(f"/api/v1/runs/{run['id']}").json()["progress"]["step"] == 499


def test_a_batch_over_ten_thousand_points_is_refused(api):
    run = create(api)["runs"][0]
    points = [{"key": "k", "step": s, "value": 1.0} for s in range(10_001)]
    r = api.post(f"/api/v1/runs/{run['id']}/metrics", json={"points": points})
    assert r.status_code == 422 and "10000" in r.json()["detail"]
    ok = api.post(f"/api/v1/runs/{run['id']}/metrics", json={"points": points[:10_000]})
    assert ok.status_code == 200 and ok.json()["inserted"] == 10_000


def test_downsampling_keeps_a_one_step_spike_and_bounds_the_points(api):
    run = create(api)["runs"][0]
    n, spike = 20_000, 12_345
    values = [3.0 + 0.1 * math.sin(s / 50) for s in range(n)]
    values[spike] = 40.0
    values[777] = -1.0
    for i in range(0, n, 10_000):
        api.post(f"/api/v1/runs/{run['id']}/metrics", json={"points": [
            {"key": "train/loss", "step": s, "value": values[s], "tokens": 8 * s} for s in range(i, i + 10_000)]})
    s = api.get(f"/api/v1/runs/{run['id']}/metrics/train/loss?max_points=200").json()
    assert s["downsampled"] and s["total_points"] == n and len(s["step"]) <= 200
    assert s["step"] == sorted(s["step"])
    assert spike in s["step"] and s["value"][s["step"].index(spike)] == 40.0
    assert 777 in s["step"] and s["value"][s["step"].index(777)] == -1.0
    # zooming in re-buckets the window, still with its spike
    z = api.get(f"/api/v1/runs/{run['id']}/metrics/train/loss?max_points=100&x_min=12000&x_max=13000").json()
    assert min(z["step"]) >= 12000 and max(z["step"]) <= 13000 and spike in z["step"]
    # the x range may be given in tokens
    t = api.get(f"/api/v1/runs/{run['id']}/metrics/train/loss?max_points=100&x=tokens&x_min=8000&x_max=8800").json()
    assert t["step"][0] == 1000 and t["step"][-1] == 1100


def test_non_finite_values_are_stored_as_gaps(api):
    run = create(api)["runs"][0]
    body = '{"points": [{"key": "train/loss", "step": 3, "value": NaN}, {"key": "train/loss", "step": 4, "value": 1.5}]}'
    r = api.post(f"/api/v1/runs/{run['id']}/metrics", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert api.get(f"/api/v1/runs/{run['id']}/metrics/train/loss").json()["value"] == [None, 1.5]


def test_the_compact_series_form_stores_what_the_row_form_stores(api):
    exp = create(api)
    rows_run, series_run = exp["runs"][0]["id"], exp["runs"][1]["id"]
    pts = [(s, 5.0 - s / 100 if s % 7 else None, s * 1024, 1.8e9 + s) for s in range(300)]
    rows = [{"key": k, "step": s, "value": v, "tokens": t, "wall_time": w} for k in ("train/loss", "lr")
            for s, v, t, w in pts]
    series = [{"key": k, "points": [list(p) for p in pts]} for k in ("lr", "train/loss")]  # another key order
    assert api.post(f"/api/v1/runs/{rows_run}/metrics", json={"points": rows}).json()["inserted"] == 600
    first = api.post(f"/api/v1/runs/{series_run}/metrics", json={"series": series}).json()
    assert (first["inserted"], first["duplicates"]) == (600, 0)
    again = api.post(f"/api/v1/runs/{series_run}/metrics", json={"series": series[:1]}).json()
    assert (again["inserted"], again["duplicates"]) == (0, 300)
    for key in ("train/loss", "lr"):
        a, b = (api.get(f"/api/v1/runs/{r}/metrics/{key}?max_points=1000").json() for r in (rows_run, series_run))
        assert {k: v for k, v in a.items() if k != "run_id"} == {k: v for k, v in b.items() if k != "run_id"}
    assert api.get(f"/api/v1/runs/{series_run}").json()["progress"]["step"] == 299


@pytest.mark.parametrize("point, fragment", [
    ([1.5, 1.0, None, None], "step must be an integer"), (["1", 1.0, None, None], "integer"),
    ([True, 1.0, None, None], "integer"), ([1, "2", None, None], "number"), ([1, 1.0, None], "series.0.points.0.3: Field required"),
    ([-1, 1.0, None, None], "greater than or equal to 0"), ([2**63, 1.0, None, None], "less than or equal to"),
])
def test_the_series_form_is_validated_like_the_row_form(api, point, fragment):
    run = create(api)["runs"][0]["id"]
    r = api.post(f"/api/v1/runs/{run}/metrics", json={"series": [{"key": "k", "points": [point]}]})
    assert r.status_code == 422 and fragment in r.json()["detail"], r.text
    assert api.get(f"/api/v1/runs/{run}/metrics").json()["keys"] == []


def test_the_series_form_takes_integral_floats_and_stores_non_finite_values_as_gaps(api):
    run = create(api)["runs"][0]["id"]
    body = '{"series": [{"key": "train/loss", "points": [[3.0, NaN, 8.0, Infinity], [4, 1.5, null, 2.0]]}]}'
    r = api.post(f"/api/v1/runs/{run}/metrics", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["inserted"] == 2, r.text
    got = api.get(f"/api/v1/runs/{run}/metrics/train/loss").json()
    assert (got["step"], got["value"], got["tokens"], got["wall_time"]) == ([3, 4], [None, 1.5], [8, None], [None, 2.0])
    assert api.post(f"/api/v1/runs/{run}/metrics", content=b"{", headers={"content-type": "application/json"}
                    ).status_code == 422


def test_status_machine_and_cancel(api):
    exp = create(api)
    a, b, c = (r["id"] for r in exp["runs"])
    assert api.post(f"/api/v1/runs/{a}/status", json={"status": "running", "worker_host": "h",
                                                      "device_name": "cpu"}).json()["status"] == "running"
    done = api.post(f"/api/v1/runs/{a}/status", json={"status": "succeeded", "summary": {"final_loss": 2.5}}).json()
    assert done["status"] == "succeeded" and done["finished_at"] and done["summary"]["final_loss"] == 2.5
    r = api.post(f"/api/v1/runs/{a}/status", json={"status": "running"})
    assert r.status_code == 409 and "already ended" in r.json()["detail"]
    assert api.post(f"/api/v1/runs/{a}/cancel").status_code == 409
    # a queued run is cancelled at once; a running one is flagged and stopped by its worker
    assert api.post(f"/api/v1/runs/{b}/cancel").json()["status"] == "cancelled"
    api.post(f"/api/v1/runs/{c}/status", json={"status": "running"})
    flagged = api.post(f"/api/v1/runs/{c}/cancel").json()
    assert flagged["status"] == "running" and flagged["cancel_requested"]
    ingest = api.post(f"/api/v1/runs/{c}/metrics", json={"points": [{"key": "x", "step": 0, "value": 1}]}).json()
    assert ingest["cancel_requested"] is True
    assert api.post(f"/api/v1/runs/{c}/status", json={"status": "cancelled"}).json()["status"] == "cancelled"
    filtered = api.get(f"/api/v1/runs?experiment_id={exp['id']}&status=cancelled").json()
    assert sorted(r["id"] for r in filtered["items"]) == [b, c]
    assert api.get("/api/v1/runs?recipe=nvfp4&q=bf16_last").json()["total"] == 1


def test_missing_objects_give_404_with_a_message(api):
    assert api.get("/api/v1/runs/999").json() == {"detail": "run 999 does not exist"}
    assert api.post("/api/v1/runs/999/metrics", json={"points": []}).status_code == 404
    assert api.get("/api/v1/experiments/999/series").status_code == 404


def test_writes_need_the_token_when_one_is_configured(database_url, tmp_path):
    api = make_client(database_url, tmp_path, token="s3cret")
    assert api.post("/api/v1/experiments", json=EXPERIMENT).status_code == 401
    bad = api.post("/api/v1/experiments", json=EXPERIMENT, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and "Authorization: Bearer" in bad.json()["detail"]
    ok = api.post("/api/v1/experiments", json=EXPERIMENT, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 201
    assert api.get("/api/v1/experiments").status_code == 200  # reads stay open
    run_id = ok.json()["runs"][0]["id"]
    assert api.post(f"/api/v1/runs/{run_id}/cancel").status_code == 401


def test_external_runs_for_users_own_scripts(api):
    exp = create(api)
    r = api.post("/api/v1/runs", json={"experiment_id": exp["id"], "recipe": "fp8_rowwise", "label": "my script"})
    assert r.status_code == 201 and r.json()["external"] and r.json()["status"] == "running"
    assert api.post("/api/v1/runs", json={"experiment_id": 12345}).status_code == 404


def test_experiment_series_returns_every_run(api):
    exp = create(api)
    for i, run in enumerate(exp["runs"]):
        api.post(f"/api/v1/runs/{run['id']}/metrics", json={"points": [
            {"key": "train/loss", "step": s, "value": 4.0 + i, "tokens": s * 100} for s in range(10)]})
    body = api.get(f"/api/v1/experiments/{exp['id']}/series?keys=train/loss,val/loss&max_points=50").json()
    assert len(body["runs"]) == 3
    assert all(len(r["series"]["train/loss"]["step"]) == 10 for r in body["runs"])
    assert all(r["series"]["val/loss"]["step"] == [] for r in body["runs"])
    assert api.get(f"/api/v1/experiments/{exp['id']}/series?x=furlongs").status_code == 422


def test_artifacts_say_whether_their_path_is_still_there(api, tmp_path):
    run = create(api)["runs"][0]
    kept, pruned = tmp_path / "checkpoints" / "step_00000020", tmp_path / "checkpoints" / "step_00000010"
    kept.mkdir(parents=True)
    pruned.mkdir(parents=True)
    for path, step in ((pruned, 10), (kept, 20), ("s3://bucket/run/step_20", 20)):
        r = api.post(f"/api/v1/runs/{run['id']}/artifacts", json={"kind": "checkpoint", "path": str(path), "step": step})
        assert r.status_code == 201, r.text
    pruned.rmdir()  # the trainer keeps only the newest checkpoints
    listed = api.get(f"/api/v1/runs/{run['id']}/artifacts").json()
    assert [(a["step"], a["exists"]) for a in listed] == [(10, False), (20, True), (20, None)]
