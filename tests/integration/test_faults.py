"""Faults on the real services (PostgreSQL, Redis, the API and a Celery worker as processes): each ends with
every run `succeeded` and a gap-free, duplicate-free loss series."""
from __future__ import annotations

import os
import signal
import time

from tests.integration.conftest import TINY, tiny_training


def _complete(stack, run_id: int, steps: int) -> None:
    series = stack.series(run_id)
    expected = list(range(1, steps + 1)) if series["step"][0] == 1 else list(range(steps))
    assert series["step"] == expected


def test_the_whole_worker_killed_and_restarted_resumes_the_run_within_two_minutes(stack):
    steps = 40
    exp = stack.create(name="worker-kill", **TINY, training=tiny_training(steps, checkpoint_every=5),
                       recipes=["bf16"])
    run_id = exp["runs"][0]["id"]
    stack.wait(lambda: (stack.run(run_id).get("progress") or {}).get("step", 0) >= 12, 180, "a checkpoint or two")
    os.killpg(stack.procs["worker"].pid, signal.SIGKILL)  # the worker, its pool and the training job
    stack.procs["worker"].wait(timeout=10)
    killed_at = time.monotonic()
    stack.start_worker()
    stack.wait(lambda: stack.run(run_id)["attempts"] >= 2, 120, "the run started again")
    assert time.monotonic() - killed_at < 120
    exp = stack.wait_final(exp["id"], timeout=240)
    run = exp["runs"][0]
    assert run["status"] == "succeeded", stack.log("worker") + stack.log("api")
    _complete(stack, run_id, steps)


def test_a_job_that_starts_while_the_api_is_down_waits_for_it(stack):
    os.killpg(stack.procs["worker"].pid, signal.SIGKILL)
    stack.procs["worker"].wait(timeout=10)
    exp = stack.create(name="api-down", **TINY, training=tiny_training(10), recipes=["bf16"])
    run_id = exp["runs"][0]["id"]
    os.killpg(stack.procs["api"].pid, signal.SIGTERM)
    stack.procs["api"].wait(timeout=20)
    stack.start_worker()
    time.sleep(8)  # the job has started and is retrying its first request
    stack.restart_api()
    exp = stack.wait_final(exp["id"], timeout=240)
    assert exp["runs"][0]["status"] == "succeeded", stack.log("worker")
    _complete(stack, run_id, 10)


class PrivateRedis:
    """A redis-server of this test's own (no persistence), so restarting it disturbs nothing else."""

    def __init__(self, tmp):
        from tests.integration.conftest import free_port

        self.port, self.tmp, self.proc = free_port(), tmp, None

    def start(self):
        import subprocess

        import redis

        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.tmp)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if redis.Redis(port=self.port).ping():
                    return self
            except redis.ConnectionError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)

    def stop(self):
        self.proc.kill()
        self.proc.wait(timeout=10)


def test_redis_restarted_without_persistence_loses_no_job(postgres_url, tmp_path):
    from tests.integration.conftest import Stack

    redis_server = PrivateRedis(tmp_path).start()
    stack = Stack(tmp_path, postgres_url, 1, redis_url=f"redis://127.0.0.1:{redis_server.port}/0").up()
    try:
        exp = stack.create(name="redis-restart", **TINY, training=tiny_training(30, checkpoint_every=5),
                           recipes=["bf16", "fp8_tensorwise", "fp8_rowwise"])
        ids = [r["id"] for r in exp["runs"]]
        stack.wait(lambda: [stack.run(i)["status"] for i in ids].count("running") == 1, 120, "one run running")
        assert [stack.run(i)["status"] for i in ids].count("queued") == 2
        redis_server.stop()  # the two queued messages are gone with it
        redis_server.start()
        exp = stack.wait_final(exp["id"], timeout=400)
        assert [r["status"] for r in exp["runs"]] == ["succeeded"] * 3, stack.log("worker")[-3000:]
        for run_id in ids:
            _complete(stack, run_id, 30)
    finally:
        stack.down()
        redis_server.stop()


def test_a_bad_status_payload_mid_run_is_a_422_and_the_run_goes_on_and_can_be_cancelled(stack):
    """One malformed status update (the probe's `progress.step: "x"`) once froze a live run: now it is refused
    with 422, nothing stored changes, training continues, and a cancel still reaches the loop."""
    steps = 60
    exp = stack.create(name="bad-status", **TINY, training=tiny_training(steps), recipes=["bf16", "fp8_tensorwise"])
    first, second = (r["id"] for r in exp["runs"])
    stack.wait(lambda: (stack.run(first).get("progress") or {}).get("step", 0) >= 5, 180, "training under way")
    for bad in ({"progress": {"step": "x"}}, {"status": "running", "progress": {"step": 1.5}},
                {"status": "nonsense"}, {"status": "running", "summary": "not an object"}):
        r = stack.api.post(f"/runs/{first}/status", json=bad)
        assert r.status_code == 422, (bad, r.status_code, r.text)
        assert isinstance(r.json()["detail"], str) and r.json()["detail"]
    run = stack.run(first)
    assert run["status"] == "running" and isinstance(run["progress"]["step"], int)   # nothing of them was stored
    before = run["progress"]["step"]
    stack.wait(lambda: stack.run(first)["progress"]["step"] > before + 5, 120, "steps after the bad updates")
    exp = stack.wait(lambda: stack.run(first)["status"] == "succeeded", 240, "the first run to finish")
    _complete(stack, first, steps)
    # The second run is cancelled while it trains, after a bad update to it too.
    stack.wait(lambda: (stack.run(second).get("progress") or {}).get("step", 0) >= 3, 180, "the second run")
    assert stack.api.post(f"/runs/{second}/status", json={"progress": {"step": "x"}}).status_code == 422
    assert stack.api.post(f"/runs/{second}/cancel").status_code == 200
    stack.wait(lambda: stack.run(second)["status"] == "cancelled", 120, "the cancel to land")
    series = stack.series(second)
    assert series["step"] == sorted(set(series["step"])) and series["step"][-1] < steps
