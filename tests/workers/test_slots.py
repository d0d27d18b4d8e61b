"""GPU slots: `plab worker` plans one slot per GPU (or one for all with --multi-gpu, or N CPU slots); each pool
process pins itself to its slot as it starts; a job's environment carries the slot's devices."""
from __future__ import annotations

import os
import time

import billiard
import pytest

from plab.cli.services import worker_plan
from workers import tasks


@pytest.mark.parametrize("gpus, slots, multi_gpu, expected", [
    (["0", "1"], None, False, ["0", "1"]),
    (["2", "3"], None, True, ["2,3", "2,3"]),
    ([], 3, False, ["cpu", "cpu", "cpu"]),
])
def test_pool_process_i_gets_slot_i_of_the_workers_plan(gpus, slots, multi_gpu, expected):
    plan = worker_plan(gpus, slots, multi_gpu, None, None)
    slots_env = ";".join(plan["slots"])  # what `plab worker` exports as PLAB_WORKER_SLOTS
    assert [tasks.slot_devices(slots_env, i) for i in range(len(expected))] == expected


def test_a_worker_without_slots_pins_nothing():
    assert tasks.slot_devices("", 0) is None


def _pinned(_):
    time.sleep(0.3)  # keeps this process busy, so the next item goes to the other one
    from billiard.process import current_process

    return current_process().index, os.environ.get(tasks.SLOT_ENV), tasks.job_env()["CUDA_VISIBLE_DEVICES"]


def test_each_process_of_a_real_prefork_pool_pins_itself_to_its_own_gpu(monkeypatch):
    monkeypatch.setenv("PLAB_WORKER_SLOTS", "4;5")
    monkeypatch.delenv(tasks.SLOT_ENV, raising=False)
    # billiard's Pool is the one Celery's prefork pool runs; _pin_slot is what runs at each process's start.
    pool = billiard.Pool(processes=2, initializer=tasks._pin_slot)
    try:
        seen = set(pool.map(_pinned, range(6), chunksize=1))
    finally:
        pool.terminate()
        pool.join()
    assert seen == {(0, "4", "4"), (1, "5", "5")}


def test_a_jobs_environment_takes_the_slots_devices_and_its_share_of_threads(monkeypatch):
    monkeypatch.setenv(tasks.SLOT_ENV, "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setenv("PLAB_JOB_THREADS", "8")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = tasks.job_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["OMP_NUM_THREADS"] == "8"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a value the operator set wins
    assert tasks.job_env()["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv(tasks.SLOT_ENV, "cpu")
    assert tasks.job_env()["CUDA_VISIBLE_DEVICES"] == ""  # a CPU slot hides every GPU


def test_outside_a_worker_the_environment_is_passed_through(monkeypatch):
    monkeypatch.delenv(tasks.SLOT_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")
    assert tasks.job_env()["CUDA_VISIBLE_DEVICES"] == "6"


def test_a_slot_refuses_a_job_that_needs_more_gpus_than_it_has(monkeypatch):
    from workers.tasks import SLOT_ENV, placement_problem

    monkeypatch.setenv(SLOT_ENV, "cpu")
    assert placement_problem(1) is None
    assert "needs 4 GPUs (training.gpus) but this worker slot is CPU only" in placement_problem(4)
    monkeypatch.setenv(SLOT_ENV, "0,1")
    assert placement_problem(2) is None
    assert "this worker slot has 2" in placement_problem(4)
