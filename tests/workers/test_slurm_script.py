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
