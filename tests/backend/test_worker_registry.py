"""Workers register what they offer; a run that no live worker of its queue can place is refused at submission
(422 naming what the workers offer), one that some worker can place - or that waits for a worker - is not."""
from __future__ import annotations

from datetime import timedelta

from fastapi.testclient import TestClient

from backend.app import create_app
from plab.settings import Settings


def _api(tmp_path) -> TestClient:
    return TestClient(create_app(Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'p.sqlite'}",
                                          broker_url="filesystem://", api_token=None, data_dir=tmp_path,
                                          api_url="http://test"), migrate=True))


def _experiment(api, **training):
    return api.post("/api/v1/experiments", json={"name": "w", "training": {"steps": 40, "batch_size": 8, **training},
                                                 "recipes": ["bf16"], "enqueue": True})


def test_runs_must_fit_a_live_worker_of_their_queue(tmp_path):
    api = _api(tmp_path)
    assert _experiment(api, gpus=2).status_code == 201            # no worker yet: the run waits for one
    cpu = {"queues": ["default", "cpu"], "slots": 2, "gpus_per_slot": 0, "launcher": "local"}
    r = api.put("/api/v1/workers/plab@cpu-box", json=cpu)
    assert r.status_code == 200 and r.json()["live"] is True
    refused = _experiment(api, gpus=2)
    assert refused.status_code == 422
    assert "plab@cpu-box" in refused.json()["detail"] and "2 GPUs" in refused.json()["detail"]
    n_before = len(api.get("/api/v1/experiments").json()["items"])
    assert _experiment(api, gpus=1).status_code == 201
    assert len(api.get("/api/v1/experiments").json()["items"]) == n_before + 1   # the refused one left nothing
    assert _experiment(api, gpus=2, queue="h100").status_code == 201           # another queue: waits
    # Several nodes need a Slurm worker; a GPU worker with enough devices per slot takes 2 GPUs.
    assert _experiment(api, nodes=2).status_code == 422
    api.put("/api/v1/workers/plab@gpu-box", json={"queues": ["default"], "slots": 1, "gpus_per_slot": 4,
                                                  "launcher": "local"})
    assert _experiment(api, gpus=2).status_code == 201
    api.put("/api/v1/workers/plab@login", json={"queues": ["default"], "slots": 4, "gpus_per_slot": 0,
                                                "launcher": "slurm"})
    assert _experiment(api, nodes=2).status_code == 201
    names = {w["name"]: w for w in api.get("/api/v1/workers").json()}
    assert set(names) == {"plab@cpu-box", "plab@gpu-box", "plab@login"} and all(w["live"] for w in names.values())


def test_a_worker_that_stopped_registering_is_not_counted(tmp_path):
    from backend.db import session_factory, transaction
    from backend.models import Worker, utcnow

    api = _api(tmp_path)
    api.put("/api/v1/workers/old", json={"queues": ["default"], "slots": 1, "gpus_per_slot": 0, "launcher": "local"})
    with transaction(session_factory(f"sqlite:///{tmp_path / 'p.sqlite'}")) as s:
        s.get(Worker, "old").last_seen = utcnow() - timedelta(minutes=10)
    assert _experiment(api, gpus=2).status_code == 201
    assert api.get("/api/v1/workers").json()[0]["live"] is False


def test_registration_is_validated(tmp_path):
    api = _api(tmp_path)
    for bad in ({"queues": [], "slots": 1, "gpus_per_slot": 0}, {"queues": ["a b"], "slots": 1, "gpus_per_slot": 0},
                {"queues": ["q"], "slots": 0, "gpus_per_slot": 0}, {"queues": ["q"], "slots": 1, "gpus_per_slot": -1},
                {"queues": ["q"], "slots": 1, "gpus_per_slot": 0, "launcher": "k8s"}):
        assert api.put("/api/v1/workers/w1", json=bad).status_code == 422, bad
