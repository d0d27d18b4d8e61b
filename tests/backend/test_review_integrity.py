"""Fixes of a review of stored-data integrity: metrics into an ended run, evaluation results checked at input (and
a stored one the statistics cannot use answered 409, not 500), huge finite metric values, CSV formula injection,
cancelling a run whose worker died, blank or multi-line names and labels, the runs list's status filter."""
from __future__ import annotations

import csv
import dataclasses
import io
from datetime import timedelta

import pytest

from backend.models import EvalResult, Run, utcnow
from tests.backend.test_api import EXPERIMENT, create, make_client
from tests.backend.test_comparison import api, finish, send  # noqa: F401 - `api` is a fixture


def _session(api):
    return api.app.state.sessionmaker()


def _series(api, run_id, key="train/loss"):
    r = api.get(f"/api/v1/runs/{run_id}/metrics/{key}", params={"max_points": 100_000})
    assert r.status_code == 200, r.text
    return r.json()


def _points(n, key="train/loss", start=0, value=1.0):
    return [{"key": key, "step": s, "tokens": 100 * (s + 1), "value": value} for s in range(start, n)]


# -- 1. metrics into an ended run ---------------------------------------------------------------------------------
def test_new_metric_points_into_an_ended_run_are_refused_but_re_sent_duplicates_still_answer_200(api):
    exp = create(api)
    bf16, fp8, nvfp4 = (r["id"] for r in exp["runs"])
    send(api, bf16, _points(10))
    finish(api, bf16)
    # A new point would rewrite the finished verdict: refused, saying why and what to do.
    r = api.post(f"/api/v1/runs/{bf16}/metrics", json={"points": _points(11, start=10, value=9.0)})
    assert r.status_code == 409, r.text
    detail = r.json()["detail"]
    assert "ended" in detail and "succeeded" in detail and "before" in detail and "train/loss step 10" in detail
    # A batch re-sent after a retry (every point already stored) is still answered 200: deduplicated.
    r = api.post(f"/api/v1/runs/{bf16}/metrics", json={"points": _points(10, value=5.0)})
    assert r.status_code == 200, r.text
    assert (r.json()["inserted"], r.json()["duplicates"], r.json()["run_status"]) == (0, 10, "succeeded")
    # ... in the compact form too; a batch mixing stored and new points is refused whole.
    r = api.post(f"/api/v1/runs/{bf16}/metrics",
                 json={"series": [{"key": "train/loss", "points": [[3, 1.0, None, None]]}]})
    assert r.status_code == 200 and r.json()["duplicates"] == 1
    r = api.post(f"/api/v1/runs/{bf16}/metrics", json={"points": _points(12, start=8)})
    assert r.status_code == 409 and "2 of its 4 points" in r.json()["detail"]
    s = _series(api, bf16)
    assert s["step"] == list(range(10)) and set(s["value"]) == {1.0}  # nothing stored changed
    # Every final status: a run cancelled while queued, a failed one; a running run still takes points.
    assert api.post(f"/api/v1/runs/{fp8}/cancel").status_code == 200
    r = api.post(f"/api/v1/runs/{fp8}/metrics", json={"points": _points(1)})
    assert r.status_code == 409 and "cancelled" in r.json()["detail"]
    assert api.post(f"/api/v1/runs/{nvfp4}/status", json={"status": "running"}).status_code == 200
    assert api.post(f"/api/v1/runs/{nvfp4}/metrics", json={"points": _points(3)}).status_code == 200
    assert api.post(f"/api/v1/runs/{nvfp4}/status", json={"status": "failed"}).status_code == 200
    assert api.post(f"/api/v1/runs/{nvfp4}/metrics", json={"points": _points(4)}).status_code == 409
    assert _series(api, nvfp4)["step"] == [0, 1, 2]


def test_the_metric_streamer_stops_its_job_once_the_run_has_ended_instead_of_retrying(api):
    """The worker side of a 409: the batch is dropped (not retried, not spilled), training is told to stop once,
    and later batches are dropped without a message each."""
    from fastapi.testclient import TestClient

    from workers.client import PlabClient

    exp = create(api)
    rid = exp["runs"][0]["id"]
    assert api.post(f"/api/v1/runs/{rid}/status", json={"status": "running"}).status_code == 200
    client = PlabClient("http://testserver", retries=0)
    client._http = TestClient(api.app, base_url="http://testserver/api/v1")
    stops = []
    streamer = client.stream(rid, flush_interval=30, on_cancel=lambda: stops.append(1))
    streamer.log(0, {"train/loss": 1.0})
    streamer.flush()
    assert streamer.sent == 1 and not streamer.run_ended
    assert api.post(f"/api/v1/runs/{rid}/status", json={"status": "failed"}).status_code == 200
    for step in (1, 2, 3):
        streamer.log(step, {"train/loss": 1.0})
        streamer.flush()
    streamer.close()
    assert streamer.run_ended and stops == [1] and streamer.dropped == 3 and streamer.spilled == 0
    assert len([e for e in streamer.errors if "has ended" in e]) == 1
    assert _series(api, rid)["step"] == [0]


# -- 2. evaluation results ----------------------------------------------------------------------------------------
def _task(acc, hash_="h" * 64, **over):
    return {"kind": "task", "aggregation": {"acc": "mean"}, "higher_is_better": {"acc": True}, "task_hash": hash_,
            "n_samples": len(acc), "metrics": {"acc": {"value": sum(acc) / len(acc), "stderr": 0.01}},
            "samples": {"doc_id": list(range(len(acc))), "acc": acc}, **over}


def _evaluation(api, run_id, tasks, status="running") -> int:
    from backend.schemas import EvaluationStatusUpdate
    from backend.services import evaluations

    with _session(api) as session:
        ev = evaluations.create_evaluation(session, run_id, tasks, None)
        for s in ("running", "succeeded")[:("running", "succeeded").index(status) + 1]:
            evaluations.update_status(session, ev.id, EvaluationStatusUpdate(status=s))
        session.commit()
        return ev.id


def _finished_with_checkpoint(api, exp):
    ids = [r["id"] for r in exp["runs"]]
    for rid in ids:
        finish(api, rid)
        r = api.post(f"/api/v1/runs/{rid}/artifacts", json={"kind": "checkpoint", "path": f"/ckpt/{rid}"})
        assert r.status_code == 201, r.text
    return ids


def _post(api, ev_id, task, result):
    return api.post(f"/api/v1/evaluations/{ev_id}/results", json={"task": task, "result": result})


@pytest.mark.parametrize("samples, fragment", [
    ({"acc": [1.0, 0.0]}, "doc_id"),
    ({"doc_id": [0, 1], "acc": [1.0]}, "2 documents"),
    ({"doc_id": [0, 0], "acc": [1.0, 0.0]}, "twice"),
    ({"doc_id": ["a", 1], "acc": [1.0, 0.0]}, "integers"),
    ({"doc_id": [0, 1], "acc": [1.0, "x"]}, "number"),
    ({"doc_id": [0, 1], "acc": 1.0}, "list"),
    ({"doc_id": [0, 1], "f1": [1.0, 0.0]}, "'acc'"),
])
def test_evaluation_samples_of_the_wrong_shape_are_refused_with_422(api, samples, fragment):
    exp = create(api, recipes=["bf16"])
    (rid,) = _finished_with_checkpoint(api, exp)
    ev = _evaluation(api, rid, ["plab_piqa"])
    r = _post(api, ev, "plab_piqa", {**_task([1.0, 0.0]), "samples": samples})
    assert r.status_code == 422, r.text
    assert fragment in r.json()["detail"] and "samples" in r.json()["detail"]
    # What the worker posts (training.evaluation.adapter's records, a group with its subtasks) is taken.
    assert _post(api, ev, "plab_piqa", _task([1.0, 0.0])).status_code == 201
    assert _post(api, ev, "plab_bpb", {"kind": "task", "aggregation": {"bits_per_byte": "bits_per_byte"},
                                       "samples": {"doc_id": [3, 1], "bits_per_byte": [[-1.0, 3], [-2.5, 4.0]]},
                                       "metrics": {}}).status_code == 201
    assert _post(api, ev, "plab_g", {"kind": "group", "subtasks": ["plab_piqa"], "metrics": {},
                                     "aggregation": {"acc": "mean"}}).status_code == 201


def test_self_referencing_and_cyclic_groups_are_refused(api):
    exp = create(api, recipes=["bf16"])
    (rid,) = _finished_with_checkpoint(api, exp)
    ev = _evaluation(api, rid, ["g1"])
    r = _post(api, ev, "g1", {"kind": "group", "subtasks": ["t", "g1"], "metrics": {}})
    assert r.status_code == 422 and "g1" in r.json()["detail"] and "itself" in r.json()["detail"]
    assert _post(api, ev, "g1", {"kind": "group", "subtasks": ["g2"], "metrics": {}}).status_code == 201
    r = _post(api, ev, "g2", {"kind": "group", "subtasks": ["g1"], "metrics": {}})
    assert r.status_code == 409 and "g2 -> g1 -> g2" in r.json()["detail"]


def test_stored_results_the_statistics_cannot_use_answer_409_not_500(api):
    exp = create(api)
    bf16, fp8, _ = _finished_with_checkpoint(api, exp)
    acc = [1.0, 0.0] * 10
    for rid in (bf16, fp8):
        ev = _evaluation(api, rid, ["plab_piqa"])
        assert _post(api, ev, "plab_piqa", _task(acc)).status_code == 201
        _evaluation_succeeded(api, ev)
    assert api.get(f"/api/v1/experiments/{exp['id']}/accuracy").status_code == 200
    # Rows stored before samples were checked: no doc_id; then a group that lists itself. Written under the API,
    # as such rows were before any table of them was computed: the cached table (keyed on the results' metrics,
    # which these writes leave alone or replace) is dropped as a server started on that database would have none.
    from backend.services import evaluations

    with _session(api) as session:
        row = session.query(EvalResult).filter_by(run_id=fp8).one()
        row.samples = {"acc": acc}
        session.commit()
    evaluations._TABLES.clear()
    r = api.get(f"/api/v1/experiments/{exp['id']}/accuracy")
    assert r.status_code == 409, r.text
    assert "doc_id" in r.json()["detail"] and f"run {fp8}" in r.json()["detail"]
    v = api.get(f"/api/v1/experiments/{exp['id']}/verdict")
    assert v.status_code == 200 and "doc_id" in v.json()["accuracy_error"]
    with _session(api) as session:
        for rid in (bf16, fp8):
            row = session.query(EvalResult).filter_by(run_id=rid).one()
            row.metrics = {"kind": "group", "subtasks": ["plab_piqa"], "aggregation": {"acc": "mean"}}
            row.samples = {}
        session.commit()
    r = api.get(f"/api/v1/experiments/{exp['id']}/accuracy")
    assert r.status_code == 409 and "plab_piqa -> plab_piqa" in r.json()["detail"]
    assert api.get(f"/api/v1/experiments/{exp['id']}/verdict").status_code == 200


def _evaluation_succeeded(api, ev_id):
    r = api.post(f"/api/v1/evaluations/{ev_id}/status", json={"status": "succeeded"})
    assert r.status_code == 200, r.text


def test_results_posted_to_an_ended_evaluation_are_refused_and_the_table_follows_an_in_place_update(api):
    exp = create(api)
    bf16, fp8, _ = _finished_with_checkpoint(api, exp)
    acc = [1.0, 0.0] * 10
    evs = {}
    for rid in (bf16, fp8):
        evs[rid] = _evaluation(api, rid, ["plab_piqa"])
        assert _post(api, evs[rid], "plab_piqa", _task(acc)).status_code == 201
        _evaluation_succeeded(api, evs[rid])
    r = _post(api, evs[fp8], "plab_piqa", _task([1.0] * 20))
    assert r.status_code == 409 and "succeeded" in r.json()["detail"] and "new evaluation" in r.json()["detail"]
    table = api.get(f"/api/v1/experiments/{exp['id']}/accuracy").json()
    row = next(r for r in table["runs"] if r["run_id"] == fp8)
    assert row["tasks"]["plab_piqa"]["acc"]["value"] == 0.5 and row["vs_bf16"][0]["delta"] == 0
    # A row changed in place (same id: a service writing it, as before this fix) is not served from the cache.
    from backend.schemas import EvalTaskResultIn
    from backend.services import evaluations

    with _session(api) as session:
        evaluations.store_result(session, evs[fp8], EvalTaskResultIn(task="plab_piqa", result=_task([1.0] * 20)))
        session.commit()
    table = api.get(f"/api/v1/experiments/{exp['id']}/accuracy").json()
    row = next(r for r in table["runs"] if r["run_id"] == fp8)
    assert row["tasks"]["plab_piqa"]["acc"]["value"] == 1.0 and row["vs_bf16"][0]["delta"] == pytest.approx(0.5)


# -- 3. huge finite values ----------------------------------------------------------------------------------------
def test_huge_finite_metric_values_are_stored_as_null_like_non_finite_ones(api):
    exp = create(api)
    bf16, fp8, nvfp4 = (r["id"] for r in exp["runs"])
    send(api, bf16, _points(2999, value=2.0))
    # An external run's logger writing the largest doubles: summed, they overflow.
    send(api, fp8, _points(2999, value=1.7e308))
    r = api.post(f"/api/v1/runs/{nvfp4}/metrics", json={"series": [{"key": "train/loss", "points": [
        [0, -1.5e301, None, 1e301], [1, 1e300, None, 2.0], [2, -1e300, None, None], [3, 2.5, None, 3.0]]}]})
    assert r.status_code == 200, r.text
    r = api.get(f"/api/v1/experiments/{exp['id']}/comparison")
    assert r.status_code == 200, r.text
    s = _series(api, fp8)
    assert len(s["value"]) == 2999 and set(s["value"]) == {None}
    s = _series(api, nvfp4)
    assert s["value"] == [None, 1e300, -1e300, 2.5] and s["wall_time"] == [None, 2.0, None, 3.0]
    keys = api.get(f"/api/v1/experiments/{exp['id']}/metrics").json()["keys"]
    assert keys == [{"key": "train/loss", "runs": 3, "points": 2999 * 2 + 4}]
    assert api.get(f"/api/v1/runs/{fp8}/metrics/train/loss", params={"max_points": 10}).status_code == 200
    from backend.schemas import MAX_METRIC_MAGNITUDE, MetricPointIn

    assert MAX_METRIC_MAGNITUDE == 1e300 and "1e300" in (MetricPointIn.model_fields["value"].description or "")


# -- 4. CSV formula injection -------------------------------------------------------------------------------------
def test_csv_export_neutralises_text_cells_that_a_spreadsheet_would_run_as_a_formula(api):
    exp = create(api, recipes=[{"name": "fp8_tensorwise", "label": "=HYPERLINK(\"http://x\")"}])
    bf16, fp8 = (r["id"] for r in exp["runs"])
    assert api.patch(f"/api/v1/runs/{bf16}", json={"label": "+cmd"}).status_code == 200
    send(api, bf16, [{"key": "-loss", "step": 0, "tokens": 1, "wall_time": -2.5, "value": -1.5}])
    send(api, fp8, [{"key": "train/loss", "step": 0, "value": 1e-5}])
    with _session(api) as session:  # labels stored before any rule about them
        session.get(Run, fp8).label = "@SUM(A1)"
        session.commit()
    r = api.get(f"/api/v1/experiments/{exp['id']}/export", params={"format": "csv"})
    assert r.status_code == 200, r.text
    rows = list(csv.DictReader(io.StringIO(r.text)))
    by = {int(row["run_id"]): row for row in rows}
    assert by[bf16]["label"] == "'+cmd" and by[bf16]["key"] == "'-loss"
    assert by[bf16]["value"] == "-1.5" and by[bf16]["wall_time"] == "-2.5"  # numbers are left alone
    assert by[fp8]["label"] == "'@SUM(A1)" and by[fp8]["key"] == "train/loss" and by[fp8]["recipe"] == "fp8_tensorwise"
    from backend.services.export import csv_cell

    assert [csv_cell(v) for v in ("=1", "\t=1", "\r=1", "-", "ok", "", -3, None, 2.5)] == [
        "'=1", "'\t=1", "'\r=1", "'-", "ok", "", -3, None, 2.5]


# -- 5. cancelling a run whose worker died ------------------------------------------------------------------------
@pytest.fixture
def rapi(database_url, tmp_path, broker):
    return make_client(database_url, tmp_path, token=None)


def _age(api, run_id, **fields):
    with _session(api) as s:
        run = s.get(Run, run_id)
        for k, v in fields.items():
            setattr(run, k, v)
        s.commit()


def _pass(api, **over):
    from backend.services.reconcile import reconcile

    settings = dataclasses.replace(api.app.state.settings, **over)
    with _session(api) as s:
        done = reconcile(s, settings)
        s.commit()
    return done


def test_a_cancelled_run_whose_worker_died_ends_cancelled_instead_of_queued_forever(rapi, broker):
    exp = rapi.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"], "enqueue": True}).json()
    rid = exp["runs"][0]["id"]
    broker.delete("default")  # a worker took the message
    assert rapi.post(f"/api/v1/runs/{rid}/status", json={"status": "running"}).status_code == 200
    assert rapi.post(f"/api/v1/runs/{rid}/cancel").json()["cancel_requested"] is True
    _age(rapi, rid, heartbeat_at=utcnow() - timedelta(seconds=120))  # ... and the worker died
    done = _pass(rapi)
    assert done["cancelled"] == [rid] and done["requeued"] == []
    run = rapi.get(f"/api/v1/runs/{rid}").json()
    assert run["status"] == "cancelled" and run["finished_at"] is not None and "heartbeat" in run["error_message"]
    assert broker.llen("default") == 0  # no job sent for a run nobody wants trained
    assert rapi.delete(f"/api/v1/runs/{rid}").status_code == 204


def test_a_queued_run_left_with_a_cancel_request_is_cancelled_once_its_message_is_gone(rapi, broker):
    exp = rapi.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16", "fp8_tensorwise"],
                                                 "enqueue": True}).json()
    stuck, other = (r["id"] for r in exp["runs"])
    # What the reconciler left before this fix: requeued although a cancel had been requested.
    _age(rapi, stuck, cancel_requested=True, dispatched_at=utcnow() - timedelta(minutes=10))
    _age(rapi, other, dispatched_at=utcnow() - timedelta(minutes=10))
    assert "cancelled" not in _pass(rapi, requeue_grace_s=0.0)  # both messages still queued: a worker skips it
    broker.flushdb()  # the worker skipped (consumed) the message; the other one Redis lost
    done = _pass(rapi, requeue_grace_s=0.0)
    assert done["cancelled"] == [stuck] and done["resent"] == [other]
    run = rapi.get(f"/api/v1/runs/{stuck}").json()
    assert run["status"] == "cancelled" and run["finished_at"] is not None
    assert broker.llen("default") == 1  # only the other run's job was sent again
    assert rapi.delete(f"/api/v1/runs/{stuck}").status_code == 204


# -- 6. validation gaps -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, fragment", [
    ("   ", "blank"), ("\u3000\u00a0 ", "blank"), ("two\nlines", "control character"),
    ("tab\there", "control character"),
    ("cr\r", "control character"), ("nel\u0085x", "control character"), ("ls\u2028x", "control character"),
])
def test_blank_or_multi_line_names_and_labels_are_refused_by_patch(api, value, fragment):
    exp = create(api)
    rid = exp["runs"][0]["id"]
    for path, field in ((f"/api/v1/experiments/{exp['id']}", "name"), (f"/api/v1/runs/{rid}", "label")):
        r = api.patch(path, json={field: value})
        assert r.status_code == 422, (field, r.text)
        assert field in r.json()["detail"] and fragment in r.json()["detail"]
    assert api.get(f"/api/v1/experiments/{exp['id']}").json()["name"] == EXPERIMENT["name"]
    # ... and by the bodies that create them (an experiment's name, a recipe's label, a recorded run's label)
    for path, body, field in (("/api/v1/experiments", {**EXPERIMENT, "name": value}, "name"),
                              ("/api/v1/experiments", {**EXPERIMENT, "recipes": [{"name": "bf16", "label": value}]},
                               "label"),
                              ("/api/v1/runs", {"experiment_id": exp["id"], "recipe": "bf16", "label": value}, "label")):
        r = api.post(path, json=body)
        assert r.status_code == 422 and field in r.json()["detail"] and fragment in r.json()["detail"], (path, r.text)
    assert api.patch(f"/api/v1/experiments/{exp['id']}", json={"name": " fp8 ünïcode run "}).status_code == 200
    assert api.patch(f"/api/v1/runs/{rid}", json={"label": "bf16 (seed 0)"}).json()["label"] == "bf16 (seed 0)"


def test_the_runs_status_filter_is_one_of_the_real_statuses(api):
    exp = create(api)
    r = api.get("/api/v1/runs", params={"status": "runing"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "status" in detail and all(s in detail for s in ("queued", "running", "succeeded", "failed", "cancelled",
                                                             "diverged"))
    assert api.get("/api/v1/runs", params={"status": "queued"}).json()["total"] == len(exp["runs"])
    assert api.get("/api/v1/runs", params={"status": "diverged"}).json()["total"] == 0
    assert api.get("/api/v1/runs").json()["total"] == len(exp["runs"])
