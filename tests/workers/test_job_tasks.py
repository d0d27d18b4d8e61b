"""The one task helper (`workers.tasks.register_job` / `run_job`) with real child processes and a real API: a child
killed by a signal is retried, a child that ends without reporting leaves its row failed with a message that says
so (every job kind), and the child runs with its slot's devices. Tasks run through Celery's own eager `apply`,
which executes retries in place."""
from __future__ import annotations

import sys
import uuid
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from backend.queue import enqueue_eval, enqueue_gemm, enqueue_train
from plab.broker import EVALUATE_TASK, GEMM_TASK, TRAIN_TASK, make_app
from tests.workers.conftest import TINY, new_run
from workers import tasks
from workers.jobs import EXIT_SKIPPED, evaluate, gemm, train


def counting_child(counter, script: str) -> list[str]:
    """A short real process: adds a line to `counter` (one per start), then runs `script` (`n` = starts so far)."""
    return [sys.executable, "-c", f"import os, signal, sys\n"
                                  f"with open({str(counter)!r}, 'a') as f: f.write('x')\n"
                                  f"n = len(open({str(counter)!r}).read())\n{script}"]


def job_task(kind, command, max_retries: int = 2):
    """The real job kind with its child replaced by `command(job_id)`, registered by the helper under a fresh
    name."""
    job = SimpleNamespace(KIND=kind.KIND, command=lambda job_id, **_: command(job_id), record=kind.record,
                          status=kind.status, mark_failed=kind.mark_failed)
    return tasks.register_job(job, f"tests.workers.job_{uuid.uuid4().hex[:8]}", max_retries=max_retries)


def starts(counter) -> int:
    return len(counter.read_text()) if counter.exists() else 0


def test_a_child_killed_by_a_signal_is_retried_until_it_finishes(client, tmp_path):
    run = new_run(client)
    counter = tmp_path / "starts"
    kill_twice = "if n <= 2: os.kill(os.getpid(), signal.SIGKILL)"
    task = job_task(train, lambda _id: counting_child(counter, kill_twice), max_retries=3)
    assert task.apply(args=[run["id"]]).get() == 0
    assert starts(counter) == 3
    assert client.get_run(run["id"])["status"] == "queued"  # a child that exits 0 has reported for itself


def test_a_child_killed_every_time_is_marked_failed_after_its_retries(client, tmp_path):
    run = new_run(client)
    counter = tmp_path / "starts"
    task = job_task(train, lambda _id: counting_child(counter, "os.kill(os.getpid(), signal.SIGKILL)"),
                    max_retries=2)
    assert task.apply(args=[run["id"]]).get() == -9
    assert starts(counter) == 3
    stored = client.get_run(run["id"])
    assert stored["status"] == "failed"
    assert stored["error_message"] == ("the training process ended without reporting a result (killed by signal 9 "
                                       "(SIGKILL)); the worker's log has its output")


def new_evaluation(client) -> int:
    run = new_run(client)
    client.set_status(run["id"], "running")
    client.add_artifact(run["id"], "checkpoint", "/checkpoints/final", step=50)
    client.set_status(run["id"], "succeeded")
    return client.create_evaluation(run["id"], ["plab_arc_easy"])["id"]


def new_benchmark(client) -> int:
    return client.create_gemm_benchmark(request={"shapes": "64x128x96", "device": "cpu"}, enqueue=False)["id"]


@pytest.mark.parametrize("kind, make_row", [(train, lambda c: new_run(c)["id"]), (evaluate, new_evaluation),
                                            (gemm, new_benchmark)], ids=["train", "evaluate", "gemm"])
def test_a_child_that_crashes_without_reporting_leaves_its_row_failed(client, tmp_path, kind, make_row):
    job_id = make_row(client)
    counter = tmp_path / "starts"
    task = job_task(kind, lambda _id: counting_child(counter, "sys.exit(1)"))
    assert task.apply(args=[job_id]).get() == 1
    assert starts(counter) == 1  # an exit code is the job's own failure: not retried
    assert kind.status(client, job_id) == "failed"


def test_a_segfaulting_child_is_retried_then_marked_failed_with_the_signal(client, tmp_path):
    bench_id = new_benchmark(client)
    counter = tmp_path / "starts"
    task = job_task(gemm, lambda _id: counting_child(counter, "import ctypes; ctypes.string_at(0)"), max_retries=1)
    assert task.apply(args=[bench_id]).get() == -11
    assert starts(counter) == 2
    stored = client.get_gemm_benchmark(bench_id)
    assert stored["status"] == "failed" and "killed by signal 11 (SIGSEGV)" in stored["error_message"]


def test_a_failure_the_child_reported_itself_keeps_its_message(client, tmp_path):
    bench_id = new_benchmark(client)
    client.set_gemm_status(bench_id, "failed", error_message="CUDA out of memory")  # what the child posted
    task = job_task(gemm, lambda _id: counting_child(tmp_path / "starts", "sys.exit(1)"))
    assert task.apply(args=[bench_id]).get() == 1
    assert client.get_gemm_benchmark(bench_id)["error_message"] == "CUDA out of memory"


@pytest.mark.parametrize("slot, visible", [("3", "3"), ("0,1", "0,1"), ("cpu", "")])
def test_the_child_runs_on_its_slots_devices(client, tmp_path, monkeypatch, slot, visible):
    monkeypatch.setenv(tasks.SLOT_ENV, slot)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # the worker's own value must not leak into the job
    seen = tmp_path / "seen"
    task = job_task(train, lambda _id: [sys.executable, "-c", f"import os; open({str(seen)!r}, 'w').write("
                                                              f"os.environ['CUDA_VISIBLE_DEVICES'])"])
    assert task.apply(args=[new_run(client)["id"]]).get() == 0
    assert seen.read_text() == visible


def test_the_registered_tasks_are_the_three_job_kinds_under_the_names_the_api_sends():
    assert (tasks.train_run.name, tasks.evaluate_run.name, tasks.gemm_bench.name) == (TRAIN_TASK, EVALUATE_TASK,
                                                                                      GEMM_TASK)
    assert {tasks.train_run.max_retries, tasks.evaluate_run.max_retries, tasks.gemm_bench.max_retries} == {3, 2, 1}


def sent_messages(queue: str) -> list[tuple[str, list, dict]]:
    """The messages waiting on `queue` of this environment's (filesystem) broker: task name, args, kwargs."""
    out = []
    with make_app().connection_for_read() as conn:
        while (msg := conn.default_channel.basic_get(queue, no_ack=True)) is not None:
            args, kwargs, _embed = msg.decode()
            out.append((msg.headers["task"], args, kwargs))
    return out


def test_the_api_sends_the_gpu_count_and_the_dispatch_time_with_a_job(api_env):
    when = datetime(2026, 11, 25, 0, 30, 1, 123456, tzinfo=timezone.utc)
    ids = [enqueue_train(7, {"training": {"gpus": 2, "queue": "h100"}}, when), enqueue_eval(8, when),
           enqueue_gemm(9, "h100", when)]
    at = {"dispatched_at": "2026-11-25T00:30:01.123456+00:00"}
    # kombu's filesystem broker names a message file by the millisecond it was written and a random uuid, so two
    # messages of one millisecond come back in either order: compared by job id
    assert sorted(sent_messages("h100"), key=lambda m: m[1]) == [(TRAIN_TASK, [7], {"gpus": 2, **at}),
                                                                  (GEMM_TASK, [9], at)]
    assert sent_messages("default") == [(EVALUATE_TASK, [8], at)]
    assert len(set(ids)) == 3 and all(ids)  # each message's id, kept on its row


def sent_run(client) -> dict:
    """A run the API sent to the queue (its message waits in this test's broker folder: no worker takes it)."""
    exp = client.create_experiment({**TINY, "name": "dispatch test", "recipes": ["bf16"], "enqueue": True})
    return client.get_run(exp["runs"][0]["id"])


def test_the_message_carries_the_dispatch_the_run_records(client):
    run = sent_run(client)
    [(name, args, kwargs)] = sent_messages("default")
    assert (name, args) == (TRAIN_TASK, [run["id"]])
    assert run["dispatch_id"] and run["dispatched_at"]
    # The stored time and the message's are the same instant after the database round trip: the message stands.
    assert tasks._utc(kwargs["dispatched_at"]) == tasks._utc(run["dispatched_at"])
    assert tasks.superseded(run, kwargs["dispatched_at"]) is None


def test_a_message_the_run_was_sent_again_after_is_skipped_without_touching_the_run(client, tmp_path, monkeypatch):
    """The case that failed a demo run: a stale message (here asking for 2 GPUs, on a CPU slot) for a run id that
    has a newer dispatch must neither start a job nor fail the run at the placement check."""
    monkeypatch.setenv(tasks.SLOT_ENV, "cpu")
    run = sent_run(client)
    older = (tasks._utc(run["dispatched_at"]) - timedelta(seconds=1)).isoformat()
    counter = tmp_path / "starts"
    task = job_task(train, lambda _id: counting_child(counter, "sys.exit(0)"))
    assert task.apply(args=[run["id"]], kwargs={"gpus": 2, "dispatched_at": older}).get() == EXIT_SKIPPED
    assert starts(counter) == 0
    assert client.get_run(run["id"])["status"] == "queued" and client.get_run(run["id"])["error_message"] is None
    # The run's own message, and a message from before messages carried their time, do run.
    assert task.apply(args=[run["id"]], kwargs={"gpus": 1, "dispatched_at": run["dispatched_at"]}).get() == 0
    assert task.apply(args=[run["id"]], kwargs={"gpus": 1}).get() == 0
    assert starts(counter) == 2


def test_a_job_that_ends_without_a_report_leaves_a_run_retried_meanwhile_to_its_new_job(client, tmp_path):
    """A training child that reported `failed` drains its metrics for up to a minute before it exits; a retry in
    that window queued the run again, and the worker then marked the retried run failed ("ended without reporting
    a result") under its new job (a review). The worker leaves a row sent to the queue since its message."""
    run = sent_run(client)
    counter = tmp_path / "starts"

    def retried_meanwhile(run_id):
        client.cancel_run(run_id)  # queued: cancelled at once
        client.retry_run(run_id)   # queued again, on a new message
        return counting_child(counter, "sys.exit(1)")

    task = job_task(train, retried_meanwhile)
    assert task.apply(args=[run["id"]], kwargs={"gpus": 1, "dispatched_at": run["dispatched_at"]}).get() == 1
    after = client.get_run(run["id"])
    assert starts(counter) == 1 and after["status"] == "queued" and after["error_message"] is None
    assert after["dispatched_at"] != run["dispatched_at"]
    # Without a newer dispatch the same end marks the run failed, as before.
    task = job_task(train, lambda _id: counting_child(counter, "sys.exit(1)"))
    assert task.apply(args=[run["id"]], kwargs={"gpus": 1, "dispatched_at": after["dispatched_at"]}).get() == 1
    assert client.get_run(run["id"])["status"] == "failed"


@pytest.mark.parametrize("kind", [evaluate, gemm])
def test_an_evaluation_or_benchmark_message_sent_again_since_is_skipped(client, tmp_path, kind):
    """The reconciler re-sends a queued evaluation or benchmark whose message the broker lost; should the first
    message turn up after all (a filesystem broker's folder restored, a worker that took it late), it must not run
    the job a second time beside the new one."""
    if kind is evaluate:
        record = client.get_evaluation(new_evaluation(client))
    else:
        bench = client.create_gemm_benchmark(request={"shapes": "64x128x96", "device": "cpu"}, queue="cpu")
        record = client.get_gemm_benchmark(bench["id"])
        assert record["queue"] == "cpu"
    assert record["status"] == "queued" and record["dispatch_id"] and record["dispatched_at"]
    older = (tasks._utc(record["dispatched_at"]) - timedelta(seconds=1)).isoformat()
    counter = tmp_path / "starts"
    task = job_task(kind, lambda _id: counting_child(counter, "sys.exit(0)"))
    assert task.apply(args=[record["id"]], kwargs={"dispatched_at": older}).get() == EXIT_SKIPPED
    assert starts(counter) == 0 and kind.status(client, record["id"]) == "queued"
    assert task.apply(args=[record["id"]], kwargs={"dispatched_at": record["dispatched_at"]}).get() == 0
    assert task.apply(args=[record["id"]]).get() == 0  # a message from before messages carried their time
    assert starts(counter) == 2


@pytest.mark.parametrize("latest, sent, stands", [
    (None, "2026-11-25T00:00:00+00:00", True),                      # a run never sent (or from before the field)
    ("2026-11-25T00:00:00Z", "2026-11-25T00:00:00+00:00", True),    # the same instant, written two ways
    ("2026-11-25T00:00:00.000001+00:00", "2026-11-25T00:00:00+00:00", False),
    ("2026-11-25T01:00:00+01:00", "2026-11-25T00:00:00.5+00:00", True),  # offsets compared as instants
    ("2026-11-25T00:00:01", "2026-11-25T00:00:00+00:00", False),    # a naive stamp is UTC
    ("2026-11-25T00:00:01+00:00", "yesterday", True),               # not a time the API wrote: runs as before
])
def test_superseded_compares_instants(latest, sent, stands):
    record = {"dispatched_at": latest, "dispatch_id": "abc"}
    assert (tasks.superseded(record, sent) is None) is stands


def test_the_training_command_uses_torchrun_for_several_gpus_and_asks_the_api_when_the_message_has_no_count(client):
    run = new_run(client)
    assert train.command(run["id"], gpus=1)[1:] == ["-m", "workers.jobs.train", str(run["id"])]
    assert train.command(run["id"], gpus=2)[1:5] == ["-m", "torch.distributed.run", "--standalone",
                                                     "--nproc_per_node=2"]
    # A message queued before the count was sent: the run's spec (gpus 1 here) decides.
    assert train.command(run["id"]) == train.command(run["id"], gpus=1)


def test_a_retried_child_takes_over_the_run_its_killed_attempt_held(client, tmp_path):
    """A child that claimed the run and was then killed (the OOM killer) left a fresh lease; the worker's retry of
    the same message may take the run over at once (it used to be refused as "being trained by another job" until
    the lease went stale, and after three kills the run failed without the signal). A second delivery of the same
    attempt, or another message, is still refused while the lease is fresh."""
    run = new_run(client)
    counter = tmp_path / "starts"
    claim_then = ("from workers.client import PlabClient\n"
                  "from workers.jobs.train import holder\n"
                  "c = PlabClient.from_env()\n"
                  f"c.set_status({run['id']}, 'running', worker_host=holder())\n"
                  "if n == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
                  f"c.set_status({run['id']}, 'succeeded')\n")
    task = job_task(train, lambda _id: counting_child(counter, claim_then), max_retries=2)
    assert task.apply(args=[run["id"]]).get() == 0
    stored = client.get_run(run["id"])
    assert starts(counter) == 2 and stored["status"] == "succeeded" and stored["attempts"] == 2
    assert stored["worker_host"].endswith(" attempt 2)") and "(task " in stored["worker_host"]


def test_only_a_later_attempt_of_the_same_message_may_take_over_a_fresh_lease():
    from plab.claims import later_attempt

    held = "gpu-host-1 (task 5f1c2d attempt 1)"
    assert later_attempt("gpu-host-2 (task 5f1c2d attempt 2)", held)
    assert not later_attempt("gpu-host-1 (task 5f1c2d attempt 1)", held)  # the same attempt delivered twice
    assert not later_attempt("gpu-host-1 (task 9a8b7c attempt 2)", held)  # another message
    assert not later_attempt("gpu-host-1", held) and not later_attempt(held, "gpu-host-1")
    assert not later_attempt("slurm job 12 (node1)", held)


@pytest.mark.parametrize("kind, make_row", [(evaluate, new_evaluation), (gemm, new_benchmark)],
                         ids=["evaluate", "gemm"])
def test_a_retried_evaluation_or_benchmark_child_takes_over_its_killed_attempts_claim(client, tmp_path, kind,
                                                                                       make_row):
    """As a run's: the first attempt claimed the row with its holder, then was killed; the worker's retry of the
    same message claims it at once, while a second copy of the message (the same attempt) would be refused."""
    job_id = make_row(client)
    counter = tmp_path / "starts"
    report = "set_evaluation_status" if kind is evaluate else "set_gemm_status"
    claim_then = ("from workers.client import PlabClient\n"
                  "from workers.jobs import holder\n"
                  "c = PlabClient.from_env()\n"
                  f"c.{report}({job_id}, 'running', worker_host=holder())\n"
                  "if n == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
                  f"c.{report}({job_id}, 'failed', error_message='the second attempt ran')\n")
    task = job_task(kind, lambda _id: counting_child(counter, claim_then), max_retries=2)
    assert task.apply(args=[job_id]).get() == 0
    stored = kind.record(client, job_id)
    assert starts(counter) == 2 and stored["status"] == "failed" and stored["error_message"] == "the second attempt ran"
    assert stored["worker_host"].endswith(" attempt 2)") and "(task " in stored["worker_host"]


@pytest.mark.parametrize("kind, make_row, report", [
    (evaluate, new_evaluation, lambda c, i, **kw: c.set_evaluation_status(i, "running", **kw)),
    (gemm, new_benchmark, lambda c, i, **kw: c.set_gemm_status(i, "running", **kw))], ids=["evaluate", "gemm"])
def test_a_second_copy_of_an_evaluation_or_benchmark_message_stops_without_touching_the_row(client, monkeypatch,
                                                                                             kind, make_row, report):
    """Before 2026-12-08 nothing stopped it: a message delivered twice (Redis's redelivery of a long job, or the
    reconciler's re-send of one that was only starting) ran the evaluation twice at once. The real job module runs
    here; its work would raise, so reaching it fails the test."""
    job_id = make_row(client)
    report(client, job_id, worker_host="host-a (task 11 attempt 1)")  # the first copy's job holds it
    monkeypatch.setattr(kind.PlabClient, "from_env", classmethod(lambda cls, *a, **k: client))
    monkeypatch.setattr(client, "close", lambda: None)  # the test's client outlives the job's `with`
    monkeypatch.setenv(tasks.JOB_ATTEMPT_ENV, "22 attempt 1")
    if kind is evaluate:
        monkeypatch.setattr(kind, "_evaluate", lambda *_a: pytest.fail("the second copy evaluated"))
    else:
        import training.gemm
        monkeypatch.setattr(training.gemm, "run_gemm_benchmark", lambda **_: pytest.fail("the second copy timed"))
    assert kind.run(job_id) == EXIT_SKIPPED
    stored = kind.record(client, job_id)
    assert stored["status"] == "running" and stored["worker_host"] == "host-a (task 11 attempt 1)"


def test_an_evaluation_job_renews_its_lease_while_it_scores(client, monkeypatch):
    """workers.jobs.evaluate.run beats while lm-eval runs (the reconciler fails a running evaluation whose beats
    stop): here lm-eval's part is a pause of a few heartbeat intervals."""
    import time

    from workers.jobs import evaluate as evaluate_job

    eid = new_evaluation(client)
    beats = []
    real = client.evaluation_heartbeat

    def counted(evaluation_id, holder=None):
        beats.append(evaluation_id)
        return real(evaluation_id, holder)

    monkeypatch.setenv("PLAB_HEARTBEAT_S", "0.05")  # read when the job starts (plab.settings.get_settings)
    monkeypatch.setattr(evaluate_job.PlabClient, "from_env", classmethod(lambda cls, *a, **k: client))
    monkeypatch.setattr(client, "evaluation_heartbeat", counted)
    monkeypatch.setattr(evaluate_job, "_evaluate", lambda *_a: time.sleep(0.5) or {"lm_eval_version": "test"})
    assert evaluate_job.run(eid) == 0
    assert len(beats) >= 3 and set(beats) == {eid}
    assert client.get_evaluation(eid)["status"] == "succeeded"


def test_a_heartbeat_that_finds_its_run_claimed_by_another_job_stops_the_job(client):
    import threading

    from workers.jobs.lease import Heartbeat

    run = new_run(client)
    client.set_status(run["id"], "running", worker_host="host-b (task 22 attempt 1)")
    lost = threading.Event()
    beat = Heartbeat(client, run["id"], 0.05, on_lost=lost.set, holder="host-a (task 11 attempt 1)")
    try:
        assert lost.wait(10)
    finally:
        beat.stop()
    assert beat.lost
    mine = threading.Event()
    own = Heartbeat(client, run["id"], 0.05, on_lost=mine.set, holder="host-b (task 22 attempt 1)")
    try:
        assert not mine.wait(0.5)
    finally:
        own.stop()


def test_a_failed_rows_message_is_the_users_error_alone_or_the_exception_with_its_traceback():
    """A spec or corpus error says what to fix; its traceback (the training library's frames) was noise in the
    row's error. Any other exception keeps the end of its traceback for whoever debugs it."""
    from training import launch  # noqa: F401 - imported by every job that opens a spec
    from training.config import SpecError
    from workers.jobs import error_message

    def raised(exc):
        try:
            raise exc
        except BaseException as e:  # noqa: BLE001
            return e

    spec = raised(SpecError("keep_bf16 pattern(s) ['layer.0.*'] match no linear layer"))
    assert error_message(spec) == "SpecError: keep_bf16 pattern(s) ['layer.0.*'] match no linear layer"
    other = error_message(raised(RuntimeError("CUDA error: an illegal memory access")))
    assert other.startswith("RuntimeError: CUDA error: an illegal memory access\n\nTraceback") and "raised" in other


def test_a_gemm_benchmark_job_renews_its_lease_while_it_times(client, monkeypatch):
    import time

    import training.gemm
    from workers.jobs import gemm as gemm_job

    bid = new_benchmark(client)
    beats = []
    real = client.gemm_heartbeat
    monkeypatch.setenv("PLAB_HEARTBEAT_S", "0.05")
    monkeypatch.setattr(gemm_job.PlabClient, "from_env", classmethod(lambda cls, *a, **k: client))
    monkeypatch.setattr(client, "gemm_heartbeat", lambda i, holder=None: beats.append(i) or real(i, holder))
    monkeypatch.setattr(client, "close", lambda: None)  # the test's client outlives the job's `with`

    def slow_then_broken(**_):
        time.sleep(0.5)
        raise RuntimeError("no GEMMs today")
    monkeypatch.setattr(training.gemm, "run_gemm_benchmark", slow_then_broken)
    with pytest.raises(RuntimeError):
        gemm_job.run(bid)
    assert len(beats) >= 3 and set(beats) == {bid}
    assert client.get_gemm_benchmark(bid)["status"] == "failed"


@pytest.mark.parametrize("kind, make_row, report", [
    (train, lambda c: new_run(c)["id"], lambda c, i, who: c.set_status(i, "running", worker_host=who)),
    (evaluate, new_evaluation, lambda c, i, who: c.set_evaluation_status(i, "running", worker_host=who)),
    (gemm, new_benchmark, lambda c, i, who: c.set_gemm_status(i, "running", worker_host=who))],
    ids=["train", "evaluate", "gemm"])
def test_a_child_that_crashes_leaves_a_row_another_job_holds_to_that_job(client, tmp_path, kind, make_row, report):
    """The worker fails a row whose child ended without reporting (a segfault, an exit before its claim), unless
    another job holds the row: a second copy of the message, whose child crashed, failed the evaluation the first
    copy's job was scoring."""
    job_id = make_row(client)
    report(client, job_id, "host-a (task 11 attempt 1)")  # the first copy's job
    task = job_task(kind, lambda _id: counting_child(tmp_path / "starts", "sys.exit(1)"))
    assert task.apply(args=[job_id]).get() == 1
    stored = kind.record(client, job_id)
    assert stored["status"] == "running" and stored["worker_host"] == "host-a (task 11 attempt 1)"


def test_a_row_is_another_jobs_unless_this_job_or_an_earlier_attempt_of_its_message_claimed_it():
    from workers.jobs import held_by_another

    me = "host-b (task 5f1c2d attempt 2)"
    assert held_by_another({"status": "running", "worker_host": "host-a (task 9a8b7c attempt 1)"}, me)
    assert held_by_another({"status": "running", "worker_host": "host-a (task 5f1c2d attempt 2)"}, me)  # a copy
    assert not held_by_another({"status": "running", "worker_host": me}, me)
    assert not held_by_another({"status": "running", "worker_host": "host-a (task 5f1c2d attempt 1)"}, me)  # killed
    assert not held_by_another({"status": "running", "worker_host": None}, me)
    assert not held_by_another({"status": "queued", "worker_host": "host-a (task 9a8b7c attempt 1)"}, me)
