"""Training through a real Slurm cluster (tests/integration/slurm_cluster.py: Debian's slurmctld, two slurmd
nodes and munge on this machine, CPU only), with the real API, PostgreSQL, Redis and a worker started as
`plab worker --launcher slurm`: a run on 2 nodes x 1 process trains to `succeeded` with a complete series and
every rank's log; a cancel in the API ends its Slurm job; a Slurm requeue mid-run (what preemption does) resumes
the run from its checkpoint with a gap-free series."""
from __future__ import annotations

import os
import re
import signal

import pytest

from tests.integration import slurm_cluster
from tests.integration.conftest import TINY, compose_command, tiny_training


@pytest.fixture
def slurm(tmp_path):
    why = slurm_cluster.available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why + " (scripts/test.sh installs them)")
        pytest.skip(why)
    cluster = slurm_cluster.SlurmCluster(tmp_path / "slurm").up()
    yield cluster
    cluster.down()


@pytest.fixture
def slurm_stack(stack, slurm):
    """The integration stack with its worker replaced by a Slurm launcher worker."""
    os.killpg(stack.procs["worker"].pid, signal.SIGKILL)
    stack.procs["worker"].wait(timeout=10)
    stack.env["SLURM_CONF"] = slurm.env["SLURM_CONF"]  # the cluster's only addition (its env is os.environ + it)
    stack.start("worker", compose_command("worker") + ["--slots", "3", "--launcher", "slurm", "--cpu-nodes", "--queues", "slurm",
                                                       "--slurm-poll-s", "1"])
    stack.slurm = slurm
    return stack


def _slurm_job(stack, run_id: int) -> str:
    return stack.wait(lambda: ((stack.run(run_id).get("summary") or {}).get("slurm") or {}).get("job_id"), 60,
                      "the run's Slurm job id")


def _job_state(stack, job_id: str) -> str:
    return re.search(r"JobState=(\S+)", stack.slurm.scontrol("show", "job", "-o", job_id)).group(1)


REQUEUED_STEPS = 40


def _complete(stack, run_id: int, steps: int) -> None:
    series = stack.series(run_id)
    assert series["step"] == list(range(1, steps + 1)), series["step"]


@pytest.mark.slow
def test_runs_train_cancel_and_resume_through_slurm(slurm_stack):
    stack = slurm_stack
    two_nodes = dict(tiny_training(16, checkpoint_every=5), nodes=2, gpus=1, batch_size=4, queue="slurm")
    # Three runs at once (the worker has 3 slots, the cluster room for all): one trains through, one is preempted
    # mid-run, one is cancelled.
    plain = stack.create(name="slurm", **TINY, training=two_nodes, recipes=["bf16"])
    requeued = stack.create(name="slurm-requeue", **TINY, training=dict(two_nodes, steps=REQUEUED_STEPS),
                            recipes=["bf16"])
    cancelled = stack.create(name="slurm-cancel", **TINY, training=dict(two_nodes, steps=400), recipes=["bf16"])
    run_id, requeue_id, cancel_id = (e["runs"][0]["id"] for e in (plain, requeued, cancelled))
    job, requeue_job, cancel_job = (_slurm_job(stack, r) for r in (run_id, requeue_id, cancel_id))

    # Preemption: Slurm requeues the running job (and would hold it 2 minutes; released at once here); the same
    # Slurm job starts again, claims the run and resumes from its last checkpoint. Requeued as soon as the first
    # checkpoint (step 5) is behind it and long before its last step: `scontrol requeue` also takes a job that has
    # already completed, and a run that had finished before it would only be skipped by the job's second start (a
    # fresh-clone CI run, with the cancel below done first, requeued this run after its 30 steps).
    stack.wait(lambda: (stack.run(requeue_id).get("progress") or {}).get("step", 0) >= 6, 240, "the first checkpoint")
    before = stack.run(requeue_id)
    assert before["status"] == "running" and before["progress"]["step"] < REQUEUED_STEPS, before
    # Incomplete: only a job still running is requeued, as preemption does.
    assert "error" not in stack.slurm.scontrol("requeue", "Incomplete", requeue_job).lower()

    # Cancel in the API: the Slurm job ends, the run is cancelled.
    stack.wait(lambda: stack.run(cancel_id)["status"] == "running", 120, "the run to start")
    assert stack.api.post(f"/runs/{cancel_id}/cancel").status_code == 200
    stack.wait(lambda: stack.run(cancel_id)["status"] == "cancelled", 120, "the cancel")
    stack.wait(lambda: _job_state(stack, cancel_job) in ("CANCELLED", "COMPLETED"), 60, "the Slurm job to end")
    stack.wait(lambda: _job_state(stack, requeue_job) == "PENDING", 60, "the requeued job to wait for its begin time")
    stack.slurm.scontrol("update", f"JobId={requeue_job}", "StartTime=now")

    exp = stack.wait_final(plain["id"], timeout=300)
    run = exp["runs"][0]
    assert run["status"] == "succeeded", stack.log("worker") + stack.slurm.log()
    assert run["worker_host"].startswith(f"slurm job {job} ")
    assert run["summary"]["world_size"] == 2 and run["summary"]["slurm"]["job_id"] == job
    _complete(stack, run_id, 16)
    stack.wait(lambda: _job_state(stack, job) == "COMPLETED", 60, "the Slurm job to complete")

    def logs():
        # The worker records the job's log files one by one: wait for both ranks', not for the first file.
        found = [a for a in stack.api.get(f"/runs/{run_id}/artifacts").json() if a["kind"] == "log"]
        ranks = sorted(a["meta"]["rank"] for a in found if a["meta"].get("rank") is not None)
        return found if ranks == [0, 1] else None
    logs = stack.wait(logs, 60, "both ranks' logs recorded as artifacts")
    assert all(a["exists"] and not a["path"].startswith("/") for a in logs)

    exp = stack.wait_final(requeued["id"], timeout=300)
    run = exp["runs"][0]
    assert run["status"] == "succeeded", stack.log("worker") + stack.slurm.log()
    assert run["attempts"] >= 2
    _complete(stack, requeue_id, REQUEUED_STEPS)
    stack.wait(lambda: _job_state(stack, requeue_job) == "COMPLETED", 60, "the requeued job to complete")
