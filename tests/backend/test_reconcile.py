"""The reconciler against the real Redis broker: a run whose worker stopped heartbeating is sent again (then
failed after PLAB_MAX_ATTEMPTS), a queued run whose message Redis lost is sent again, and a job claims its run
so a duplicate message never trains it twice at once."""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import redis

from backend.models import Run, utcnow
from backend.services.reconcile import reconcile
from tests.backend.test_api import EXPERIMENT, make_client
from tests.integration.conftest import REDIS_URL, _claim_redis_db


@pytest.fixture
def broker(monkeypatch, tmp_path):
    db, lock = _claim_redis_db()
    url = f"{REDIS_URL}/{db}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    monkeypatch.setenv("PLAB_BROKER_URL", url)
    monkeypatch.setenv("PLAB_HOME", str(tmp_path))
    yield client
    client.flushdb()
    client.close()
    lock.close()


@pytest.fixture
def api(tmp_path, broker):
    return make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path, token=None)


def _session(api):
    return api.app.state.sessionmaker()


def _queued_messages(broker) -> int:
    return broker.llen("default")


def _age(api, run_id: int, **fields):
    with _session(api) as s:
        run = s.get(Run, run_id)
        for k, v in fields.items():
            setattr(run, k, v)
        s.commit()


def _pass(api, **over):
    settings = dataclasses.replace(api.app.state.settings, **over)
    with _session(api) as s:
        done = reconcile(s, settings)
        s.commit()
    return done


def test_a_second_job_cannot_claim_a_run_another_job_holds(api, broker):
    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"]}).json()
    rid = exp["runs"][0]["id"]
    assert api.post(f"/api/v1/runs/{rid}/status", json={"status": "running"}).status_code == 200
    second = api.post(f"/api/v1/runs/{rid}/status", json={"status": "running"})
    assert second.status_code == 409 and "another job" in second.json()["detail"]
    assert api.post(f"/api/v1/runs/{rid}/heartbeat").json() == {"status": "running", "cancel_requested": False}
    _age(api, rid, heartbeat_at=utcnow() - timedelta(minutes=5))
    assert api.post(f"/api/v1/runs/{rid}/status", json={"status": "running"}).status_code == 200


def test_a_run_whose_worker_died_is_sent_again_then_failed_after_max_attempts(api, broker):
    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"], "enqueue": True}).json()
    rid = exp["runs"][0]["id"]
    assert _queued_messages(broker) == 1
    broker.delete("default")  # a worker took the message
    assert api.post(f"/api/v1/runs/{rid}/status", json={"status": "running"}).status_code == 200
    assert _pass(api) == {"requeued": [], "failed": [], "resent": []}  # heartbeat fresh
    _age(api, rid, heartbeat_at=utcnow() - timedelta(seconds=120))
    assert _pass(api)["requeued"] == [rid]
    assert api.get(f"/api/v1/runs/{rid}").json()["status"] == "queued"
    assert _queued_messages(broker) == 1
    for _ in range(2):  # started again twice more, and the worker dies each time
        api.post(f"/api/v1/runs/{rid}/status", json={"status": "running"})
        _age(api, rid, heartbeat_at=utcnow() - timedelta(seconds=120))
        _pass(api)
    run = api.get(f"/api/v1/runs/{rid}").json()
    assert run["status"] == "failed" and "stopped heartbeating" in run["error_message"] and run["attempts"] == 3


def test_a_queued_run_whose_message_redis_lost_is_sent_again(api, broker):
    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16", "fp8_tensorwise"],
                                                "enqueue": True}).json()
    ids = [r["id"] for r in exp["runs"]]
    assert _queued_messages(broker) == 2
    assert _pass(api, requeue_grace_s=0.0)["resent"] == []  # still in the queue
    broker.flushdb()  # Redis restarted without persistence
    assert _pass(api)["resent"] == []  # within the grace period nothing is assumed lost
    assert sorted(_pass(api, requeue_grace_s=0.0)["resent"]) == sorted(ids)
    assert _queued_messages(broker) == 2
    assert _pass(api, requeue_grace_s=0.0)["resent"] == []  # found again: not sent twice
