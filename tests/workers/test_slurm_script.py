"""The Slurm launcher's pieces without a cluster: the batch script, the options, the run-spec and placement rules
for several nodes, and the API's claim rule for a requeued Slurm job (tests/integration/test_slurm.py runs the
whole path on a real Slurm)."""
from __future__ import annotations

from pathlib import Path

import pytest

from training.config import RunSpec, SpecError
from workers.slurm import SlurmOptions, batch_script
from workers.tasks import placement_problem


def test_the_batch_script_asks_for_nodes_gpus_and_requeue_and_starts_torchrun_per_node():
    opts = SlurmOptions(partition="gpu", account="proj", time_limit="04:00:00", extra=["--qos=high"])
    script = batch_script(7, nodes=4, gpus=8, log_dir=Path("/shared/plab/runs/7/logs"), opts=opts, python="/v/bin/python")
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", "#SBATCH --requeue",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=04:00:00", "#SBATCH --qos=high"):
        assert line in script.splitlines(), line
    assert "--nnodes=\"$SLURM_NNODES\" --nproc-per-node=8 --rdzv-backend=c10d" in script
    assert "-m workers.jobs.train 7" in script and "rank%t.out" in script
    cpu = batch_script(7, nodes=2, gpus=1, log_dir=Path("/l"), opts=SlurmOptions(gpus=False), python="python")
    assert "--gpus-per-node" not in cpu


def test_options_travel_to_the_pool_processes_through_the_environment(monkeypatch):
    opts = SlurmOptions(partition="p", time_limit="1:00:00", gpus=False, extra=["--constraint=h100", "--qos=x y"],
                        poll_s=2.5)
    for k, v in opts.to_env().items():
        monkeypatch.setenv(k, v)
    assert SlurmOptions.from_env() == opts


def test_several_nodes_need_a_slurm_worker_and_divide_the_batch():
    assert "Slurm worker" in placement_problem(1, nodes=2)
    assert placement_problem(1, nodes=1) is None
    base = {"model": "tiny", "data": {"corpus": "random", "vocab_size": 256, "seq_len": 16},
            "training": {"steps": 30, "batch_size": 6, "gpus": 2, "nodes": 2}}
    with pytest.raises(SpecError, match="grad_accum x gpus x nodes"):
        RunSpec.from_dict(base)
    ok = RunSpec.from_dict({**base, "training": {**base["training"], "batch_size": 8}})
    assert ok.training.nodes == 2


def test_the_same_slurm_job_may_claim_its_run_again_but_no_one_else(tmp_path):
    from fastapi.testclient import TestClient

    from backend.app import create_app
    from plab.settings import Settings

    api = TestClient(create_app(Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'p.sqlite'}",
                                         broker_url="filesystem://", api_token=None, data_dir=tmp_path,
                                         api_url="http://test"), migrate=True))
    exp = api.post("/api/v1/experiments", json={"name": "s", "training": {"steps": 40}, "enqueue": False}).json()
    run = exp["runs"][0]["id"]

    def claim(host):
        return api.post(f"/api/v1/runs/{run}/status", json={"status": "running", "worker_host": host}).status_code

    assert claim("slurm job 41 (n1)") == 200
    assert claim("slurm job 41 (n2)") == 200          # requeued: the same job, on another first node
    assert claim("slurm job 42 (n1)") == 409          # another Slurm job
    assert claim("gpu-host-3") == 409                 # another worker


def test_a_supervisor_whose_run_was_sent_again_stops_without_touching_it(monkeypatch, tmp_path):
    """A run retried while its old Slurm job was still completing: the old job's supervisor wrote its job back into
    the run's summary and then failed the retried run ("ended without the run reporting a result") under the new
    job (a review). It now stops once the run's dispatch is not the one it started for."""
    from workers import slurm

    calls = []
    run = {"id": 7, "status": "queued", "cancel_requested": False, "summary": {},
           "dispatched_at": "2026-12-07T10:05:00+00:00"}

    class Client:
        def get_run(self, run_id):
            return dict(run)

        def update_run(self, run_id, **fields):
            calls.append(("update_run", fields))

        def set_status(self, run_id, status, **fields):
            calls.append(("set_status", status))

        def heartbeat(self, run_id):
            calls.append(("heartbeat",))

    monkeypatch.setenv("PLAB_HOME", str(tmp_path))
    states = iter([("COMPLETING", None), ("COMPLETED", None)])
    monkeypatch.setattr(slurm, "job_state", lambda job_id: next(states))
    old = slurm.SlurmRun(Client(), 7, slurm.SlurmOptions(poll_s=0.0), 3, env={})
    old.dispatch = "2026-12-07T10:00:00+00:00"  # what start() read: the dispatch before the retry
    assert old.watch("41") == "queued" and calls == []

    # The supervisor of the run's own dispatch ends it as before when its job ends without a report.
    run.update(status="running")
    monkeypatch.setattr(slurm, "job_state", lambda job_id: ("COMPLETED", None))
    own = slurm.SlurmRun(Client(), 7, slurm.SlurmOptions(poll_s=0.0), 3, env={})
    own.dispatch = run["dispatched_at"]
    assert own.watch("42") == "failed"
    assert ("set_status", "failed") in calls
