"""Bounded specs, strict types, column-sized integers, NUL characters, size caps and stored-JSON schemas: each
refused with a 422 that names the field, never accepted into a 500 later."""
from __future__ import annotations

import pytest

from tests.backend.test_api import EXPERIMENT, create, make_client


@pytest.fixture
def api(tmp_path):
    return make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path)


def _detail(r) -> str:
    assert r.status_code == 422, (r.status_code, r.text)
    return r.json()["detail"]


@pytest.mark.parametrize("section, key, limit", [
    ("training", "steps", 10_000_000), ("training", "batch_size", 65_536), ("training", "gpus", 1_024),
    ("data", "seq_len", 1_048_576), ("training", "grad_accum", 65_536)])
def test_spec_integers_are_bounded_at_submission(api, section, key, limit):
    body = {**EXPERIMENT, section: {**EXPERIMENT.get(section, {}), key: limit + 1}}
    assert f"{section}.{key} must be <= {limit:,}" in _detail(api.post("/api/v1/experiments", json=body))
    if key == "steps":
        body = {**EXPERIMENT, "training": {"steps": 10**15}}
        assert "training.steps must be <=" in _detail(api.post("/api/v1/experiments", json=body))


def test_model_dims_are_bounded(api):
    model = {"hidden_size": 10**6, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    assert "model.hidden_size must be <= 65,536" in _detail(api.post("/api/v1/experiments",
                                                                        json={**EXPERIMENT, "model": model}))


def test_no_coercion_of_strings_or_booleans_into_numbers(api):
    for seed in ("1", True, 1.5):
        _detail(api.post("/api/v1/experiments", json={**EXPERIMENT, "seed": seed}))
    run = create(api)["runs"][0]
    for value in ("1.5", True):
        r = api.post(f"/api/v1/runs/{run['id']}/metrics",
                     json={"points": [{"key": "train/loss", "step": 0, "value": value}]})
        _detail(r)
    ok = api.post(f"/api/v1/runs/{run['id']}/metrics", json={"points": [{"key": "train/loss", "step": 0, "value": 2}]})
    assert ok.status_code == 200, ok.text  # an integer is a valid float


@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_nul_characters_are_refused_in_text_and_kept_in_free_form_json(db, tmp_path, request):
    """PostgreSQL text cannot hold NUL: refused (422) in every string the schema types, which says so (a pattern).
    Free-form JSON (a run's summary, an artifact's meta, ...) is stored in `json` columns, which keep the escape
    as written: a NUL there round-trips."""
    url = f"sqlite:///{tmp_path / 'plab.sqlite'}" if db == "sqlite" else request.getfixturevalue("postgres_url")
    api = make_client(url, tmp_path)
    assert "NUL" in _detail(api.post("/api/v1/experiments", json={**EXPERIMENT, "name": "a\x00b"}))
    assert "NUL" in _detail(api.post("/api/v1/experiments", json={**EXPERIMENT, "data": {"text_field": "t\x00"}}))
    run = create(api)["runs"][0]
    assert "NUL" in _detail(api.post(f"/api/v1/runs/{run['id']}/status",
                                     json={"status": "running", "worker_host": "w\x00"}))
    summary = {"k\x00": ["v\x00", {"\x00": 1}]}
    r = api.post(f"/api/v1/runs/{run['id']}/status", json={"status": "running", "summary": summary})
    assert r.status_code == 200, r.text
    assert api.get(f"/api/v1/runs/{run['id']}").json()["summary"] == summary
    art = api.post(f"/api/v1/runs/{run['id']}/artifacts", json={"kind": "log", "path": "x", "meta": {"m": "\x00"}})
    assert art.status_code == 201 and art.json()["meta"] == {"m": "\x00"}, art.text
    pattern = api.get("/openapi.json").json()["components"]["schemas"]["StatusUpdate"]["properties"]
    assert pattern["worker_host"]["anyOf"][0]["pattern"] == "^[^\\u0000]*$"
    # In the URL too (a search on PostgreSQL answered 500, found by the fuzz test): refused, as the document says.
    for url in ("/api/v1/runs?q=%00", "/api/v1/experiments?q=a%00", f"/api/v1/runs/{run['id']}/metrics/a%00b"):
        assert "NUL" in _detail(api.get(url))
    params = api.get("/openapi.json").json()["paths"]["/api/v1/runs"]["get"]["parameters"]
    assert next(p for p in params if p["name"] == "q")["schema"]["anyOf"][0]["pattern"] == "^[^\\u0000]*$"


def test_integers_fit_their_columns(api):
    run = create(api)["runs"][0]
    _detail(api.post(f"/api/v1/runs/{run['id']}/status", json={"status": "diverged", "diverged_step": 2**62}))
    _detail(api.post(f"/api/v1/runs/{run['id']}/artifacts", json={"kind": "checkpoint", "path": "/x", "step": 2**62}))
    ok = api.post(f"/api/v1/runs/{run['id']}/artifacts", json={"kind": "checkpoint", "path": "/x", "step": 2**31 - 1})
    assert ok.status_code in (200, 201), ok.text


def test_stored_json_is_capped(api):
    run = create(api)["runs"][0]
    r = api.post(f"/api/v1/runs/{run['id']}/status", json={"status": "running", "summary": {"x": "y" * (2 << 20)}})
    assert "over the 1,048,576-byte limit" in _detail(r)


def test_gemm_shapes_must_be_numbers(api):
    shape = {"layer": "layers.0.attn.q", "gemm": "fprop", "m": "<img src=x onerror=alert(1)>", "k": 1, "n": 1,
             "count": 1}
    detail = _detail(api.post("/api/v1/gemm-benchmarks", json={"result": {"shapes": [shape], "results": []}}))
    assert "result.shapes[0].m" in detail


def test_a_bad_progress_payload_is_422_and_ingest_goes_on(api):
    run = create(api)["runs"][0]
    rid = run["id"]
    _detail(api.post(f"/api/v1/runs/{rid}/status", json={"status": "running", "progress": {"step": "x"}}))
    _detail(api.post(f"/api/v1/runs/{rid}/status", json={"status": "running", "progress": {"foo": 1}}))
    good = api.post(f"/api/v1/runs/{rid}/status", json={"status": "running", "progress": {"step": 3, "total": 40}})
    assert good.status_code == 200, good.text
    r = api.post(f"/api/v1/runs/{rid}/metrics", json={"points": [{"key": "train/loss", "step": 5, "value": 2.0}]})
    assert r.status_code == 200, r.text
    assert api.get(f"/api/v1/runs/{rid}").json()["progress"]["step"] == 5


def test_ingest_survives_a_bad_progress_row_stored_before_validation(api, tmp_path):
    import sqlite3

    run = create(api)["runs"][0]
    db = sqlite3.connect(tmp_path / "plab.sqlite")
    db.execute("update runs set progress = ? where id = ?", ('{"step": "x"}', run["id"]))
    db.commit()
    db.close()
    r = api.post(f"/api/v1/runs/{run['id']}/metrics", json={"points": [{"key": "train/loss", "step": 1, "value": 2.0}]})
    assert r.status_code == 200, r.text
    assert api.get(f"/api/v1/runs/{run['id']}").json()["progress"]["step"] == 1


def test_eval_task_names_are_checked_at_creation(api):
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, "eval_tasks": ["plab_piqaa"]})
    assert "unknown task 'plab_piqaa'; did you mean plab_piqa" in _detail(r)
    assert api.post("/api/v1/experiments", json={**EXPERIMENT, "eval_tasks": ["plab_piqa", "plab_blimp"]}
                    ).status_code == 201


def test_eval_task_names_are_checked_when_an_existing_run_is_evaluated(api):
    """POST /runs/{id}/evaluations (and `plab eval RUN_ID`, which calls it) checks its tasks as an experiment's
    eval_tasks are: a typo was queued as an evaluation that could only fail in the worker. Nothing is stored."""
    run = create(api)["runs"][0]
    for body in ({"status": "running", "worker_host": "h"}, {"status": "succeeded"}):
        assert api.post(f"/api/v1/runs/{run['id']}/status", json=body).status_code == 200
    assert api.post(f"/api/v1/runs/{run['id']}/artifacts", json={"kind": "checkpoint", "path": "/tmp/x"}
                    ).status_code == 201
    r = api.post(f"/api/v1/runs/{run['id']}/evaluations", json={"tasks": ["plab_blimpp"]})
    assert r.status_code == 422 and "tasks: unknown task 'plab_blimpp'; did you mean plab_blimp" in _detail(r)
    assert api.get(f"/api/v1/runs/{run['id']}/evaluations").json() == []


def test_training_queue_is_accepted_and_checked(api):
    ok = api.post("/api/v1/experiments", json={**EXPERIMENT, "training": {"steps": 40, "queue": "h100"}})
    assert ok.status_code == 201, ok.text
    run = api.get(f"/api/v1/runs/{ok.json()['runs'][0]['id']}").json()
    assert run["spec"]["training"]["queue"] == "h100"
    assert "training.queue must be a queue name" in _detail(
        api.post("/api/v1/experiments", json={**EXPERIMENT, "training": {"steps": 40, "queue": "a b"}}))


def test_a_long_recipe_fits_the_run_label_column(database_url, tmp_path):
    """A label made from many settings (found by the fuzz test on PostgreSQL: a 500 from varchar(200)) is cut to fit,
    with room for a seed replicate's " seed=N"; recipes whose labels then coincide stay apart (" #2")."""
    api = make_client(database_url, tmp_path)
    keep = [f"layers.{i % 4}.mlp.{'*' * (1 + i // 4)}" for i in range(40)]  # each names a layer of tiny's 4 blocks
    body = {**EXPERIMENT, "enqueue": False, "replicates": 2, "replicate": "all",
            "recipes": [{"name": "mxfp8", "keep_bf16": keep}, {"name": "mxfp8", "keep_bf16": keep + ["*"]}]}
    r = api.post("/api/v1/experiments", json=body)
    assert r.status_code == 201, r.text
    labels = [run["label"] for run in r.json()["runs"]]
    assert len(labels) == 6 and len(set(labels)) == 6 and max(map(len, labels)) <= 200, labels
    assert any(" #2 seed=" in label for label in labels), labels
