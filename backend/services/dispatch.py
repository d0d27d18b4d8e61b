"""Sending jobs to the workers (training a run, evaluating a checkpoint, a GEMM benchmark), and the one rule for
a job queue that is down.

A job's row is committed before the job is sent, so that a fast worker finds the row it is sent. When the broker
refuses a job (down, unreachable, misconfigured), the row stays stored and is marked `failed` with the reason as
its error message - nothing re-sends a job later, so a row left `queued` would wait forever - and the jobs after
it in the same request are not tried (each try waits on the broker's connection retries). A request that asked
for the job is then answered 503 (`QueueUnavailable`) saying what was stored and what to do. A worker's report
that its run succeeded, which starts the experiment's automatic evaluation, is answered as usual: the report was
stored, and the evaluation carries the failure for the user to see and start again.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from backend import queue
from backend.errors import QueueUnavailable
from backend.models import Evaluation, Experiment, GemmBenchmark, Run, utcnow
from backend.schemas import (EvaluationCreate, EvaluationStatusUpdate, ExperimentCreate, GemmBenchmarkCreate,
                             StatusUpdate)
from backend.services import evaluations, gemm, runs

log = logging.getLogger(__name__)
_WHAT_TO_DO = "check that the broker named by PLAB_BROKER_URL is running and reachable from the API"


@dataclass(frozen=True)
class _Job:
    row_id: int
    send: Callable[[], None]
    fail: Callable[[str], None]  # marks the row failed with the reason, if it is still queued


def _send(session: Session, jobs: Sequence[_Job]) -> tuple[list[int], str | None]:
    """Commit, then send the jobs in order. On the first refusal, that job and every later one are marked failed
    (committed). Returns the ids of the rows marked failed and the broker's error (None when every job was sent)."""
    session.commit()
    for i, job in enumerate(jobs):
        try:
            job.send()
        except Exception as e:  # noqa: BLE001 - whatever the broker raised, the job did not reach a worker
            error = f"{type(e).__name__}: {e}"
            log.error("job for row %s could not be sent to the job queue: %s", job.row_id, error)
            for unsent in jobs[i:]:
                unsent.fail(f"could not be sent to the job queue: {error}")
            session.commit()
            return [j.row_id for j in jobs[i:]], error
    return [], None


def _train_job(session: Session, run: Run) -> _Job:
    def fail(reason: str) -> None:
        if run.status == "queued":
            runs.update_status(session, run.id, StatusUpdate(status="failed", error_message=reason))

    def send() -> None:
        now = utcnow()
        run.dispatch_id, run.dispatched_at = queue.enqueue_train(run.id, run.spec, now), now

    return _Job(run.id, send, fail)


def _eval_job(session: Session, ev: Evaluation) -> _Job:
    def fail(reason: str) -> None:
        if ev.status == "queued":
            evaluations.update_status(session, ev.id, EvaluationStatusUpdate(status="failed", error_message=reason))

    def send() -> None:
        now = utcnow()
        ev.dispatch_id, ev.dispatched_at = queue.enqueue_eval(ev.id, now), now

    return _Job(ev.id, send, fail)


def _gemm_job(session: Session, bench: GemmBenchmark) -> _Job:
    def fail(reason: str) -> None:
        if bench.status == "queued":
            gemm.update_status(session, bench.id, status="failed", error_message=reason)

    def send() -> None:
        now = utcnow()
        bench.dispatch_id, bench.dispatched_at = queue.enqueue_gemm(bench.id, bench.queue or "default", now), now

    return _Job(bench.id, send, fail)


def submit_experiment(session: Session, body: ExperimentCreate) -> Experiment:
    """An experiment with one run per recipe, each run sent to a worker when `body.enqueue`."""
    exp = runs.create_experiment(session, body)
    if not body.enqueue:
        return exp
    from backend.services.workers import check_placement

    for run in exp.runs:
        check_placement(session, run.spec)
    failed, error = _send(session, [_train_job(session, run) for run in exp.runs])
    if failed:
        runs_failed = ("run " if len(failed) == 1 else "runs ") + ", ".join(str(i) for i in failed)
        raise QueueUnavailable(f"experiment {exp.id} was stored, but the job queue is unavailable ({error}): "
                               f"{runs_failed} marked failed; {_WHAT_TO_DO}, then submit the experiment again",
                               stored={"experiment_id": exp.id, "failed_run_ids": failed})
    return exp


def start_evaluation(session: Session, run_id: int, body: EvaluationCreate) -> Evaluation:
    """An lm-eval job on the run's final checkpoint, sent to a worker (its tasks checked first, as an
    experiment's eval_tasks are)."""
    runs.check_eval_tasks(body.tasks, "tasks")
    ev = evaluations.create_evaluation(session, run_id, body.tasks, body.limit)
    failed, error = _send(session, [_eval_job(session, ev)])
    if failed:
        raise QueueUnavailable(f"evaluation {ev.id} of run {run_id} was stored, but the job queue is unavailable "
                               f"({error}): it is marked failed; {_WHAT_TO_DO}, then start the evaluation again",
                               stored={"evaluation_id": ev.id})
    return ev


def submit_gemm_benchmark(session: Session, body: GemmBenchmarkCreate) -> GemmBenchmark:
    """A queued benchmark (sent to a worker of `body.queue` when `body.enqueue`) or a finished result."""
    bench = gemm.create_benchmark(session, request=body.request, result=body.result,
                                  experiment_id=body.experiment_id, name=body.name)
    if body.request is None or not body.enqueue:
        return bench
    bench.queue = body.queue
    failed, error = _send(session, [_gemm_job(session, bench)])
    if failed:
        raise QueueUnavailable(f"GEMM benchmark {bench.id} was stored, but the job queue is unavailable ({error}): "
                               f"it is marked failed; {_WHAT_TO_DO}, then submit the benchmark again",
                               stored={"gemm_benchmark_id": bench.id})
    return bench


def retry_run(session: Session, run_id: int) -> Run:
    """A failed or cancelled run sent to a worker again (`runs.reopen`); it resumes from its last checkpoint."""
    run = runs.reopen(session, run_id)
    from backend.services.workers import check_placement

    check_placement(session, run.spec, retry_of=run_id)
    failed, error = _send(session, [_train_job(session, run)])
    if failed:
        raise QueueUnavailable(f"run {run_id} was put back in the queue, but the job queue is unavailable ({error}): "
                               f"it is marked failed again; {_WHAT_TO_DO}, then retry it again",
                               stored={"run_id": run_id})
    return run


def record_run_status(session: Session, run_id: int, body: StatusUpdate, stale_s: float = 60.0) -> Run:
    """A worker's status report; a run that succeeded is evaluated on the experiment's `eval_tasks` at once."""
    run = runs.update_status(session, run_id, body, stale_s)
    ev = evaluations.automatic_evaluation(session, run)
    if ev is not None:
        _send(session, [_eval_job(session, ev)])
    return run


def resend(session: Session, row: Run | Evaluation | GemmBenchmark) -> bool:
    """Sends a queued job's message again (the reconciler's re-enqueue of a run, an evaluation or a GEMM benchmark);
    False (and the row left as it is) when the broker refuses, to be tried again at the next pass."""
    job = {Run: _train_job, Evaluation: _eval_job, GemmBenchmark: _gemm_job}[type(row)](session, row)
    try:
        job.send()
    except Exception as e:  # noqa: BLE001 - the broker is down: the next pass tries again
        log.warning("could not re-send %s %s: %s", row.__tablename__[:-1], row.id, e)
        return False
    return True
