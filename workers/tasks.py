"""Celery tasks, one per job kind, all registered by `register_job`: each runs its job in a child process pinned
to this pool slot's device(s), retries a job killed by a signal, and marks the job's row failed when the child
ended without reporting an outcome."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from datetime import datetime, timezone

from celery import Task
from celery.signals import worker_process_init
from celery.utils.log import get_task_logger

from plab import run_folder
from plab.broker import EVALUATE_TASK, GEMM_TASK, TRAIN_TASK
from plab.settings import get_settings
from workers.celery_app import app
from workers.client import PlabClient
from workers.jobs import (EXIT_OK, EXIT_SKIPPED, JOB_ATTEMPT_ENV, UNREPORTED, Job, evaluate, gemm, held_by_another,
                          holder, train)

log = get_task_logger(__name__)
SLOT_ENV = "PLAB_SLOT_DEVICES"  # set per pool process: the CUDA_VISIBLE_DEVICES value of that slot


def slot_devices(slots: str, index: int) -> str | None:
    """The devices of pool process `index` under `PLAB_WORKER_SLOTS` ("0;1", "0,1" for one multi-GPU slot,
    "cpu;cpu"): slot i of `plab worker --gpus 0,1,...` gets GPU i. None when the worker set no slots."""
    listed = [s for s in slots.split(";") if s]
    return listed[index % len(listed)] if listed else None


@worker_process_init.connect
def _pin_slot(**_kw) -> None:
    """Give each pool process its own device(s)."""
    from billiard.process import current_process

    devices = slot_devices(os.environ.get("PLAB_WORKER_SLOTS", ""), getattr(current_process(), "index", 0) or 0)
    if devices is not None:
        os.environ[SLOT_ENV] = devices


def _die_with_parent() -> None:
    # If the pool process running this job is killed, the job must not train on as an orphan.
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def job_env() -> dict[str, str]:
    """The child's environment: this slot's devices as CUDA_VISIBLE_DEVICES ("" for a CPU slot), and the slot's
    share of the CPU cores as OMP_NUM_THREADS unless that is set."""
    env = dict(os.environ)
    devices = os.environ.get(SLOT_ENV)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = "" if devices == "cpu" else devices
    threads = os.environ.get("PLAB_JOB_THREADS")
    if threads:
        env.setdefault("OMP_NUM_THREADS", threads)
    # A job's spec arrived over the network: every path it names must lie in the data directory or
    # PLAB_ALLOWED_PATHS (training.config.confine), checked again here, where the files are read. The data
    # directory's documented default applies when PLAB_DATA_DIR is unset.
    env["PLAB_CONFINE_PATHS"] = "1"
    env.setdefault("PLAB_DATA_DIR", str(get_settings().data_dir))
    return env


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def placement_problem(gpus: int | None, nodes: int | None = None) -> str | None:
    """Why this pool slot cannot run a job on `gpus` GPUs (None: it can). A CPU slot runs one process; a GPU slot
    as many ranks as it has devices; several nodes need a Slurm worker."""
    if nodes and nodes > 1:
        return (f"the run needs {nodes} nodes (training.nodes) but this worker runs jobs on its own host: send it to "
                f"a Slurm worker (`plab worker --launcher slurm`, with training.queue naming its queue)")
    if not gpus or gpus <= 1:
        return None
    devices = os.environ.get(SLOT_ENV)
    have = 0 if devices in (None, "", "cpu") else len([d for d in devices.split(",") if d.strip()])
    if gpus <= have:
        return None
    where = "this worker slot is CPU only" if have == 0 else f"this worker slot has {have}"
    return (f"the run needs {gpus} GPUs (training.gpus) but {where}: send it to a worker with that many GPUs "
            f"(`plab worker --gpus ... --multi-gpu` and training.queue), or set training.gpus to {max(have, 1)}")


def _utc(text: str) -> datetime:
    stamp = datetime.fromisoformat(text)
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)


def superseded(record: dict, sent_at: str, what: str = "run") -> str | None:
    """Why a job message sent at `sent_at` must not run: its row (`record`, as the API has it: a run, an evaluation,
    a benchmark) was sent to the queue again after it, so a newer message stands for it (the reconciler re-sent a
    lost job, or the message outlived its database in a broker folder). None: this message may act."""
    latest = record.get("dispatched_at")
    try:
        if not latest or _utc(sent_at) >= _utc(latest):
            return None
    except (TypeError, ValueError):  # not a time the API wrote: act as on a message without one
        log.warning("%s %s: unreadable dispatch time %r in the message; running it", what, record.get("id"), sent_at)
        return None
    return (f"this message was sent at {sent_at}, but the {what} was sent to the queue again at {latest} "
            f"(message {record.get('dispatch_id')}): that one stands for it")


def _claim_folder(run_id: int, record: dict) -> str | None:
    """Make PLAB_HOME/runs/<id> the run's before its job starts (`plab.run_folder.claim`: a folder of another
    database's run <id> is moved aside, never resumed from). Returns why it cannot be written (the run fails with
    it, before any step is trained), or None."""
    home = get_settings().home
    try:
        # A run retried (POST /runs/{id}/retry) starts its count of attempts again but keeps started_at.
        run_folder.claim(home, run_folder.identity(run_id, record["experiment_id"], record["created_at"]),
                         started_before=(record.get("attempts") or 0) > 0 or bool(record.get("started_at")))
    except OSError as e:
        return (f"the run's folder {run_folder.folder_of(home, run_id)} cannot be written on this worker "
                f"({e.strerror or e}): give PLAB_HOME a folder the worker may write")
    return None


def run_job(task: Task, job: Job, job_id: int, **options) -> int:
    """Run `job` in a child process and make sure its row ends with an outcome. Returns the child's exit code."""
    log.info("%s %s: starting job, attempt %s", job.KIND, job_id, task.request.retries + 1)
    # Every message carries its dispatch time (training's since 2026-11-25, evaluations' and benchmarks' since
    # 2026-12-07); one without it, sent before, acts.
    sent_at = options.pop("dispatched_at", None)
    if sent_at is not None or job.KIND == train.KIND:
        # As patient as the job itself (workers.jobs.train.run): a job that arrives while the API is away waits.
        with PlabClient.from_env(retries=60) as client:
            record = job.record(client, job_id)
        stale = superseded(record, sent_at, "run" if job.KIND == train.KIND else job.KIND) if sent_at else None
        if stale is not None:
            log.warning("%s %s: skipped: %s", job.KIND, job_id, stale)
            return EXIT_SKIPPED
        if job.KIND == train.KIND and record["status"] in UNREPORTED and not record.get("external"):
            problem = _claim_folder(job_id, record)
            if problem is not None:
                with PlabClient.from_env() as client:
                    job.mark_failed(client, job_id, problem)
                return EXIT_SKIPPED
    if job is train and os.environ.get("PLAB_LAUNCHER") == "slurm":
        from workers.slurm import run_train

        env = job_env()
        env.pop("CUDA_VISIBLE_DEVICES", None)  # Slurm allocates the GPUs of the job
        return run_train(job_id, get_settings().max_attempts, env)
    problem = placement_problem(options.get("gpus"), options.get("nodes")) if job is train else None
    if problem is not None:
        with PlabClient.from_env() as client:
            if job.status(client, job_id) in UNREPORTED:
                job.mark_failed(client, job_id, problem)
        return EXIT_SKIPPED
    env = job_env()
    # Which delivery and attempt of the message the child is: a later attempt of the same message may take over
    # the row from an earlier one, which ended (a kill) before this retry (backend.services.leases).
    env[JOB_ATTEMPT_ENV] = f"{task.request.id} attempt {task.request.retries + 1}"
    proc = subprocess.run(job.command(job_id, **options), env=env, preexec_fn=_die_with_parent)
    if proc.returncode in (EXIT_OK, EXIT_SKIPPED):
        return proc.returncode
    if proc.returncode < 0 and task.request.retries < task.max_retries:
        # A kill (OOM killer, a preempted host) is not the job's fault: run it again; training resumes from
        # its last checkpoint.
        log.warning("%s %s: job %s; retrying", job.KIND, job_id, _how_it_ended(proc.returncode))
        raise task.retry(countdown=1)
    # The child reports its own exceptions; this covers an end it could not report (segfault, OOM kill). A row sent
    # to the queue again meanwhile (a run retried while this job drained its reports), or claimed by another job
    # (a second copy of the message that got there first), belongs to that job.
    with PlabClient.from_env() as client:
        record = job.record(client, job_id)
        if record["status"] in UNREPORTED and not (sent_at and superseded(record, sent_at)) \
                and not held_by_another(record, holder(env)):
            job.mark_failed(client, job_id, f"the {job.KIND} process ended without reporting a result "
                                            f"({_how_it_ended(proc.returncode)}); the worker's log has its output")
    return proc.returncode


def register_job(job: Job, name: str, max_retries: int) -> Task:
    """The Celery task `name` that runs `job` with `run_job`; the message's keyword arguments go to its command."""

    @app.task(name=name, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=max_retries)
    def job_task(self: Task, job_id: int, **options) -> int:
        return run_job(self, job, job_id, **options)

    return job_task


train_run = register_job(train, TRAIN_TASK, max_retries=3)
evaluate_run = register_job(evaluate, EVALUATE_TASK, max_retries=2)
gemm_bench = register_job(gemm, GEMM_TASK, max_retries=1)
