"""One rule for a job queue that is down, the same for every job: the job's row is stored and marked failed with
the broker's error, and the request that asked for the job is answered 503 saying what was stored and what to do.

A real API process whose PLAB_BROKER_URL points at a Redis port where nothing listens: the broker's connection
really fails, as it does when Redis is down.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO
from tests.integration.conftest import free_port

QUEUE_ERROR = "could not be sent to the job queue: OperationalError"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    home: Path = tmp_path_factory.mktemp("outage")
    port = free_port()
    env = {**os.environ, "PLAB_HOME": str(home), "PLAB_DATABASE_URL": f"sqlite:///{home / 'db.sqlite'}",
           "PLAB_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0", "PLAB_API_URL": f"http://127.0.0.1:{port}"}
    env.pop("PLAB_API_TOKEN", None)
    log = open(home / "api.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "backend.app:create_app", "--factory", "--host",
                             "127.0.0.1", "--port", str(port), "--log-level", "warning"], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=60)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (home / "api.log").read_text()
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (home / "api.log").read_text()
            time.sleep(0.2)
        yield http
    finally:
        http.close()
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def experiment(api, **over) -> dict:
    body = {"name": "outage", "training": {"steps": 20}, "recipes": ["fp8_tensorwise"], "enqueue": False, **over}
    r = api.post("/experiments", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def succeed_with_checkpoint(api, run_id: int) -> httpx.Response:
    assert api.post(f"/runs/{run_id}/status", json={"status": "running"}).status_code == 200
    art = api.post(f"/runs/{run_id}/artifacts", json={"kind": "checkpoint", "path": "/nonexistent/ckpt", "step": 20})
    assert art.status_code == 201, art.text
    return api.post(f"/runs/{run_id}/status", json={"status": "succeeded"})


def assert_refused_as_stored(r: httpx.Response, what: str, again: str) -> dict:
    """The 503 names what was stored (`what` with its id), why, and what to do; returns its `stored` ids."""
    assert r.status_code == 503, r.text
    body = r.json()
    [stored_id] = [v for k, v in body["stored"].items() if k.endswith("_id")]
    assert f"{what} {stored_id}" in body["detail"] and "was stored, but the job queue is unavailable" in body["detail"]
    assert "Connection refused" in body["detail"]
    assert "PLAB_BROKER_URL" in body["detail"] and again in body["detail"]
    return body["stored"]


def test_an_experiment_is_stored_with_its_runs_failed_and_the_client_told_503(api):
    r = api.post("/experiments", json={"name": "outage", "training": {"steps": 20},
                                        "recipes": ["fp8_tensorwise", "nvfp4"]})
    stored = assert_refused_as_stored(r, "experiment", "submit the experiment again")
    exp = api.get(f"/experiments/{stored['experiment_id']}").json()
    assert [run["recipe"] for run in exp["runs"]] == ["bf16", "fp8_tensorwise", "nvfp4"]
    assert stored["failed_run_ids"] == [run["id"] for run in exp["runs"]]
    for run in exp["runs"]:
        assert run["status"] == "failed" and run["error_message"].startswith(QUEUE_ERROR), run
        assert run["finished_at"] is not None


def test_an_experiment_that_sends_nothing_does_not_touch_the_broker(api):
    exp = experiment(api)
    assert all(run["status"] == "queued" for run in exp["runs"])


def test_an_evaluation_is_stored_failed_and_the_client_told_503(api):
    run_id = experiment(api)["runs"][0]["id"]
    assert succeed_with_checkpoint(api, run_id).status_code == 200
    r = api.post(f"/runs/{run_id}/evaluations", json={"tasks": ["plab_blimp"]})
    stored = assert_refused_as_stored(r, "evaluation", "start the evaluation again")
    assert f"of run {run_id}" in r.json()["detail"]
    ev = api.get(f"/evaluations/{stored['evaluation_id']}").json()
    assert ev["status"] == "failed" and ev["error_message"].startswith(QUEUE_ERROR)
    assert ev["run_id"] == run_id and ev["tasks"] == ["plab_blimp"]


def test_a_run_reported_succeeded_stays_succeeded_and_its_automatic_evaluation_is_stored_failed(api):
    # The worker's report was stored: answering it 503 would make the worker retry a report that cannot repeat.
    run_id = experiment(api, eval_tasks=["plab_blimp"])["runs"][0]["id"]
    r = succeed_with_checkpoint(api, run_id)
    assert r.status_code == 200 and r.json()["status"] == "succeeded"
    [ev] = api.get(f"/runs/{run_id}/evaluations").json()
    assert ev["status"] == "failed" and ev["error_message"].startswith(QUEUE_ERROR)
    assert ev["tasks"] == ["plab_blimp"]


def test_a_gemm_benchmark_is_stored_failed_and_the_client_told_503(api):
    r = api.post("/gemm-benchmarks", json={"request": {"shapes": "64x128x96"}, "name": "outage"})
    stored = assert_refused_as_stored(r, "GEMM benchmark", "submit the benchmark again")
    bench = api.get(f"/gemm-benchmarks/{stored['gemm_benchmark_id']}").json()
    assert bench["status"] == "failed" and bench["error_message"].startswith(QUEUE_ERROR)
    assert bench["name"] == "outage" and bench["request"]["shapes"] == "64x128x96"
    kept = api.post("/gemm-benchmarks", json={"request": {"shapes": "64x128x96"}, "enqueue": False})
    assert kept.status_code == 201 and kept.json()["status"] == "queued"


def test_a_retried_run_is_failed_again_with_the_reason_and_the_client_told_503(api):
    run_id = experiment(api)["runs"][0]["id"]
    assert api.post(f"/runs/{run_id}/status", json={"status": "running"}).status_code == 200
    assert api.post(f"/runs/{run_id}/status", json={"status": "failed", "error_message": "OOM"}).status_code == 200
    r = api.post(f"/runs/{run_id}/retry")
    assert r.status_code == 503 and r.json()["stored"] == {"run_id": run_id}, r.text
    detail = r.json()["detail"]
    assert detail.startswith(f"run {run_id} was put back in the queue, but the job queue is unavailable")
    assert "PLAB_BROKER_URL" in detail and detail.endswith("then retry it again")
    run = api.get(f"/runs/{run_id}").json()
    assert run["status"] == "failed" and run["error_message"].startswith(QUEUE_ERROR)
