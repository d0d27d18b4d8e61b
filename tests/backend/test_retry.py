"""POST /runs/{id}/retry against the real Redis broker: a failed or cancelled run of ours is queued again (its job
message sent, its error cleared, its start count reset, its metrics kept); anything else is refused with why."""
from __future__ import annotations

import pytest

from backend.models import Run
from tests.backend.test_api import EXPERIMENT, make_client
from tests.backend.test_reconcile import _pass, _session


@pytest.fixture
def api(tmp_path, broker):
    return make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path, token=None)


def _run(api, **over) -> int:
    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"], **over}).json()
    return exp["runs"][0]["id"]


def _report(api, rid: int, *statuses, **fields) -> None:
    for status in statuses:
        r = api.post(f"/api/v1/runs/{rid}/status", json={"status": status, **fields})
        assert r.status_code == 200, r.text


def test_a_failed_run_is_queued_again_with_its_metrics_kept(api, broker):
    rid = _run(api)
    _report(api, rid, "running")
    points = [{"key": "train/loss", "step": s, "value": 5.0 - s / 10, "tokens": 128 * s} for s in range(1, 6)]
    assert api.post(f"/api/v1/runs/{rid}/metrics", json={"points": points}).status_code == 200
    api.patch(f"/api/v1/runs/{rid}", json={"summary": {"resumed_from_step": 3, "slurm": {"job_id": "41"},
                                                       "final_loss": 4.5}})
    _report(api, rid, "failed", error_message="RuntimeError: CUDA out of memory")
    before = api.get(f"/api/v1/runs/{rid}").json()
    assert before["summary"]["resumed_from_step"] == 3
    r = api.post(f"/api/v1/runs/{rid}/retry")
    assert r.status_code == 200, r.text
    run = r.json()
    assert run["status"] == "queued" and run["error_message"] is None and run["finished_at"] is None
    assert run["attempts"] == 0 and run["started_at"] == before["started_at"] and run["worker_host"] is None
    # The next attempt's job says where it resumed and which Slurm job it is (the old one is not adopted).
    assert run["summary"] == {"final_loss": 4.5}
    assert run["dispatch_id"] and run["dispatched_at"] and broker.llen("default") == 1
    assert api.get(f"/api/v1/runs/{rid}/metrics/train/loss").json()["step"] == [1, 2, 3, 4, 5]
    again = api.post(f"/api/v1/runs/{rid}/retry")  # a second click: it is queued
    assert again.status_code == 409 and again.json()["detail"] == (
        f"run {rid} is 'queued': only a failed or cancelled run can be retried")
    assert broker.llen("default") == 1
    # It trains again: a worker claims it, and the reconciler counts its starts from zero.
    _report(api, rid, "running")
    assert api.get(f"/api/v1/runs/{rid}").json()["attempts"] == 1


def test_a_run_cancelled_while_running_or_queued_can_be_retried(api, broker):
    running, queued = _run(api), _run(api)
    _report(api, running, "running")
    for rid in (running, queued):
        assert api.post(f"/api/v1/runs/{rid}/cancel").status_code == 200
    _report(api, running, "cancelled")  # the job stopped at its next step
    for rid in (running, queued):
        run = api.post(f"/api/v1/runs/{rid}/retry").json()
        assert run["status"] == "queued" and run["cancel_requested"] is False, run
    assert broker.llen("default") == 2
    assert _pass(api, requeue_grace_s=0.0).get("cancelled") is None  # not taken for an abandoned cancel


def test_what_cannot_be_retried_is_refused_with_why(api, broker):
    done, diverged, external = _run(api), _run(api), None
    _report(api, done, "running", "succeeded")
    _report(api, diverged, "running")
    _report(api, diverged, "diverged", diverged_step=42)
    exp_id = api.get(f"/api/v1/runs/{done}").json()["experiment_id"]
    external = api.post("/api/v1/runs", json={"experiment_id": exp_id, "recipe": "bf16"}).json()["id"]
    _report(api, external, "running", "failed")
    answers = {rid: api.post(f"/api/v1/runs/{rid}/retry") for rid in (done, diverged, external, 999_999)}
    assert answers[done].status_code == 409 and "is 'succeeded'" in answers[done].json()["detail"]
    assert answers[diverged].status_code == 409 and answers[diverged].json()["detail"].startswith(
        f"run {diverged} diverged (at step 42): training is deterministic, so the same spec diverges again")
    assert answers[external].status_code == 409 and "record-only run" in answers[external].json()["detail"]
    assert answers[999_999].status_code == 404
    assert broker.llen("default") == 0
    with _session(api) as s:
        assert s.get(Run, done).status == "succeeded" and s.get(Run, external).status == "failed"


def test_until_its_new_message_is_sent_a_retried_run_names_no_dispatch(api, broker):
    """A reconciler pass between the retry's commit and its send took the old message (long gone) for lost and sent
    the run a second time (a review): the reopened run carries no dispatch until the new one is sent."""
    from backend.services import runs

    rid = _run(api, enqueue=True)
    old = api.get(f"/api/v1/runs/{rid}").json()["dispatch_id"]
    assert old and api.post(f"/api/v1/runs/{rid}/cancel").status_code == 200
    with _session(api) as s:
        run = runs.reopen(s, rid)
        assert (run.status, run.dispatch_id, run.dispatched_at) == ("queued", None, None)
        s.commit()
    assert _pass(api, requeue_grace_s=0.0) == {"requeued": [], "failed": [], "resent": []}
