"""Served mode end to end: `plab serve` + `plab worker` (the compose commands) on real PostgreSQL and Redis."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.integration.conftest import TINY, tiny_training

pytestmark = pytest.mark.integration


def test_experiment_through_rest_trains_to_success_with_a_complete_series(stack):
    steps = 12
    exp = stack.create(name="served", **TINY, training=tiny_training(steps), recipes=["bf16", "fp8_tensorwise"])
    exp = stack.wait_final(exp["id"])
    for run in exp["runs"]:
        assert run["status"] == "succeeded", (run, stack.log("worker"))
        assert run["worker_host"] and run["device_name"] and run["started_at"] and run["finished_at"]
        series = stack.series(run["id"])
        assert series["step"] == list(range(1, steps + 1)) or series["step"] == list(range(steps)), series["step"]
        assert all(v is not None for v in series["value"])
        assert len(set(series["step"])) == len(series["step"])
        # a forced re-send of the whole series changes nothing
        points = [{"key": "train/loss", "step": s, "value": v, "tokens": t}
                  for s, v, t in zip(series["step"], series["value"], series["tokens"])]
        resent = stack.api.post(f"/runs/{run['id']}/metrics", json={"points": points}).json()
        assert resent["inserted"] == 0 and resent["duplicates"] == steps
        assert stack.series(run["id"])["step"] == series["step"]
        assert run["summary"]["final_loss"] > 0
    fp8 = next(r for r in exp["runs"] if r["recipe"] == "fp8_tensorwise")
    assert fp8["gemm_backend"] == "emulated"  # no FP8 tensor cores on this CPU: labelled as such
    artifacts = stack.api.get(f"/runs/{fp8['id']}/artifacts").json()
    assert any(a["kind"] == "checkpoint" for a in artifacts)


def test_cancelling_a_running_run_stops_it_at_a_step_boundary(stack):
    exp = stack.create(name="cancel", **TINY, training=tiny_training(5000), recipes=["bf16"])
    run_id = exp["runs"][0]["id"]
    stack.wait(lambda: (stack.run(run_id).get("progress") or {}).get("step", 0) >= 3, 120, "training to start")
    r = stack.api.post(f"/runs/{run_id}/cancel")
    assert r.status_code == 200 and r.json()["cancel_requested"]
    stack.wait(lambda: stack.run(run_id)["status"] == "cancelled", 60, "the run to stop")
    last = stack.run(run_id)["progress"]["step"]
    assert 3 <= last < 5000
    time.sleep(2)
    assert stack.run(run_id)["progress"]["step"] == last  # nothing trains on after the stop


def test_a_cancelled_run_retried_resumes_from_its_checkpoint_to_a_complete_series(stack, capsys, monkeypatch):
    """`plab retry` (POST /runs/{id}/retry) on a run cancelled mid-training: a worker takes it again, it resumes
    from its last checkpoint, not step 0, and ends with a gap-free, duplicate-free loss series."""
    from plab.cli import main

    monkeypatch.setenv("PLAB_API_URL", stack.env["PLAB_API_URL"])
    monkeypatch.setenv("PLAB_API_TOKEN", stack.env["PLAB_API_TOKEN"])
    steps = 40
    exp = stack.create(name="retry", **TINY, training=tiny_training(steps, checkpoint_every=5), recipes=["bf16"])
    run_id = exp["runs"][0]["id"]
    stack.wait(lambda: (stack.run(run_id).get("progress") or {}).get("step", 0) >= 12, 180, "a checkpoint or two")
    assert stack.api.post(f"/runs/{run_id}/cancel").status_code == 200
    stack.wait(lambda: stack.run(run_id)["status"] == "cancelled", 60, "the run to stop")
    stopped = stack.run(run_id)["progress"]["step"]
    assert main(["retry", str(run_id)]) == 0
    assert f"run {run_id} (bf16) queued again" in capsys.readouterr().out
    exp = stack.wait_final(exp["id"], timeout=240)
    run = exp["runs"][0]
    assert run["status"] == "succeeded", stack.log("worker")
    # From the last checkpoint: every 5 steps, and the one a cancelled run writes where it stopped.
    resumed = stack.run(run_id)["summary"]["resumed_from_step"]
    assert 10 <= resumed <= stopped and (resumed % 5 == 0 or resumed == stopped), (resumed, stopped)
    series = stack.series(run_id)
    assert series["step"] == list(range(1, steps + 1)) or series["step"] == list(range(steps)), series["step"]
    assert main(["retry", str(run_id)]) == 2
    assert "is 'succeeded': only a failed or cancelled run can be retried" in capsys.readouterr().err


def test_a_failing_run_is_failed_with_its_message(stack):
    # The API checks that the corpus exists (this host holds the data); what is inside it only the worker reads: a
    # JSONL corpus whose lines lack data.text_field fails the run, with the reason.
    corpus = stack.tmp / "data" / "no_text.jsonl"
    corpus.write_text("".join('{"body": "%s"}\n' % ("words " * 30) for _ in range(40)))
    missing = {"corpus": "no_such_corpus", "vocab_size": 512, "seq_len": 64}
    r = stack.api.post("/experiments", json={"name": "typo", "model": "tiny", "data": missing,
                                             "training": tiny_training(5), "recipes": ["bf16"]})
    assert r.status_code == 422 and "no_such_corpus' does not exist" in r.json()["detail"]
    exp = stack.create(name="fail", model="tiny", data={**missing, "corpus": str(corpus)}, training=tiny_training(5),
                       recipes=["bf16"])
    exp = stack.wait_final(exp["id"], timeout=120)
    run = exp["runs"][0]
    assert run["status"] == "failed"
    assert run["error_message"].startswith(f"SpecError: {corpus}:1: the line has no field 'text'")


def test_a_huge_learning_rate_diverges_with_the_step(stack):
    exp = stack.create(name="diverge", **TINY, training=tiny_training(60, lr=1e6, grad_clip=0.0, warmup_steps=0),
                       recipes=["bf16"])
    exp = stack.wait_final(exp["id"], timeout=180)
    run = exp["runs"][0]
    assert run["status"] == "diverged", run
    assert run["diverged_step"] is not None and 0 <= run["diverged_step"] < 60


def test_a_killed_worker_process_is_retried_and_the_run_finishes_without_gaps_or_duplicates(stack):
    steps = 40
    exp = stack.create(name="sigkill", **TINY, training=tiny_training(steps, checkpoint_every=5), recipes=["bf16"])
    run_id = exp["runs"][0]["id"]
    stack.wait(lambda: (stack.run(run_id).get("progress") or {}).get("step", 0) >= 12, 180, "a checkpoint or two")
    worker = psutil.Process(stack.procs["worker"].pid)
    jobs = [p for p in worker.children(recursive=True) if "workers.jobs.train" in " ".join(p.cmdline())]
    assert len(jobs) == 1
    pool_process = jobs[0].parent()
    os.kill(pool_process.pid, signal.SIGKILL)  # the Celery pool process running the job dies with its job
    exp = stack.wait_final(exp["id"], timeout=240)
    run = exp["runs"][0]
    assert run["status"] == "succeeded", stack.log("worker")
    assert run["attempts"] >= 2
    series = stack.series(run_id)
    expected = list(range(1, steps + 1)) if series["step"][0] == 1 else list(range(steps))
    assert series["step"] == expected


@pytest.mark.parametrize("stack", [2], indirect=True)
def test_two_jobs_on_a_two_slot_worker_run_at_the_same_time(stack):
    exp = stack.create(name="slots", **TINY, training=tiny_training(25), recipes=["bf16", "fp8_rowwise"])
    ids = [r["id"] for r in exp["runs"]]
    both = stack.wait(lambda: all(stack.run(i)["status"] == "running" for i in ids), 120, "both runs running")
    assert both
    exp = stack.wait_final(exp["id"])
    a, b = exp["runs"]
    assert a["started_at"] < b["finished_at"] and b["started_at"] < a["finished_at"]


@pytest.fixture
def user_task_stack(tmp_path, monkeypatch, postgres_url):
    """The served stack with a user's own task in PLAB_EVAL_TASKS_DIR (the API validates task names with it, the
    worker's evaluation finds it there)."""
    from tests.integration.conftest import Stack
    from tests.user_task import write_user_task

    monkeypatch.setenv("PLAB_EVAL_TASKS_DIR", str(write_user_task(tmp_path / "my-tasks")))
    s = Stack(tmp_path, postgres_url, 2).up()
    yield s
    s.down()


def test_evaluation_through_the_worker_stores_results_and_compares_with_bf16(user_task_stack):
    from tests.user_task import CAPITALS, NAME
    from training.evaluation import SHIPPED_TASKS

    stack = user_task_stack
    # eval_tasks on the experiment: each run is evaluated as soon as its training succeeds, here on a user's own
    # task (six documents: a full evaluation in seconds; bench/eval_bench.py times the shipped tasks in full).
    exp = stack.create(name="eval", **TINY, training=tiny_training(8), recipes=["bf16", "fp8_tensorwise"],
                       eval_tasks=[NAME])
    exp = stack.wait_final(exp["id"])
    assert all(r["status"] == "succeeded" for r in exp["runs"])

    def evaluations_done():
        evs = [stack.api.get(f"/runs/{r['id']}/evaluations").json() for r in exp["runs"]]
        return evs if all(e and all(x["status"] in ("succeeded", "failed") for x in e) for e in evs) else None

    auto = stack.wait(evaluations_done, 900, "automatic evaluations")
    assert all(e[0]["status"] == "succeeded" and e[0]["tasks"] == [NAME] for e in auto), auto
    for e in auto:
        (mine,) = [r for r in e[0]["results"] if r["task"] == NAME]
        assert mine["metrics"]["n_docs"] == len(CAPITALS), mine  # every document: no limit on the automatic one
    # by hand, a few documents each: every shipped task on the baseline (each kind of result stored through the API),
    # the two the comparison below reads on the FP8 run
    compared = ["plab_piqa", "plab_arc_easy"]
    for run, tasks in zip(exp["runs"], (list(SHIPPED_TASKS), compared)):
        r = stack.api.post(f"/runs/{run['id']}/evaluations", json={"tasks": tasks, "limit": 4})
        assert r.status_code == 201, r.text
    evs = stack.wait(lambda: (lambda e: e if all(len(x) == 2 and x[1]["status"] in ("succeeded", "failed")
                                                 for x in e) else None)(
        [stack.api.get(f"/runs/{r['id']}/evaluations").json() for r in exp["runs"]]), 600, "manual evaluations")
    for e in evs:
        assert e[1]["status"] == "succeeded", e[1]["error_message"]
        stored = {r["task"] for r in e[1]["results"]}
        assert set(SHIPPED_TASKS if e[1]["run_id"] == exp["runs"][0]["id"] else compared) <= stored
        for r in e[1]["results"]:
            for metric in r["metrics"]["metrics"].values():
                assert metric["value"] is None or metric["value"] == metric["value"]  # finite or explicitly absent
    table = stack.api.get(f"/experiments/{exp['id']}/accuracy").json()
    assert table["baseline_run_id"] == exp["runs"][0]["id"]
    fp8 = next(r for r in table["runs"] if r["recipe"] == "fp8_tensorwise")
    rows = {(row["task"], row["metric"]): row for row in fp8["vs_bf16"]}
    assert ("plab_piqa", "acc") in rows and ("plab_arc_easy", "acc") in rows
    for row in rows.values():
        assert row["ci_low"] <= row["delta"] <= row["ci_high"]
        assert isinstance(row["significant"], bool)
