"""Worker jobs, one module per kind (`train`, `evaluate`, `gemm`), each with the same small interface (`Job`).

The Celery task (`workers.tasks`) runs `command(job_id)` in a child process on its pool slot's devices; the child
(`python -m workers.jobs.<kind> ID`) calls `run(job_id)`, which reports `running`, then the outcome, through the
API and returns the exit code. A child that dies without reporting (segfault, OOM kill) leaves its row queued or
running: the task then asks `status` and calls `mark_failed`. A child process per job gives each job a clean CUDA
context and memory, lets torchrun own multi-GPU jobs, and keeps a crash from taking the worker down.
"""
from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Protocol

from plab.claims import later_attempt, worker_holder
from workers.client import ApiError, PlabClient

EXIT_OK, EXIT_SKIPPED = 0, 3
# The row of a job in one of these has not been told the outcome yet.
UNREPORTED = ("queued", "running")
# The job message's id and attempt number, set by the worker for its child (workers.tasks.run_job)
JOB_ATTEMPT_ENV = "PLAB_JOB_ATTEMPT"


class Job(Protocol):
    KIND: str  # names the job in log lines and in the message of a row marked failed

    def command(self, job_id: int, **options) -> list[str]:
        """The child's command line; `options` are the task message's keyword arguments."""

    def run(self, job_id: int) -> int:
        """The child's work. Returns the exit code: EXIT_OK, or EXIT_SKIPPED for a job already ended."""

    def record(self, client: PlabClient, job_id: int) -> dict:
        """The job's row as the API has it (its status, and its latest dispatch: `dispatched_at`, `dispatch_id`)."""

    def status(self, client: PlabClient, job_id: int) -> str:
        """The job row's status as the API has it."""

    def mark_failed(self, client: PlabClient, job_id: int, message: str) -> None:
        """Record the job as failed with `message`."""


def holder(env=None) -> str:
    """Who runs the job (the worker_host its `running` report claims the row with; `env`: the job's environment,
    this process's by default): this host, or the Slurm job (the same Slurm job restarted after a requeue may claim
    its run again: Slurm runs one incarnation of a job at a time), with the job message's attempt where a worker
    started the job ("host (task <id> attempt 2)": a later attempt of the same message may take over from an
    earlier one that was killed; plab.claims)."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if job:
        return f"slurm job {job} ({socket.gethostname()})"
    return worker_holder(socket.gethostname(), env.get(JOB_ATTEMPT_ENV))


def held_by_another(record: dict, me: str) -> bool:
    """Whether the job row `record` (as the API has it) is running under another job's claim than `me`'s or an
    earlier attempt's of `me`'s message (which a kill ended before `me` started)."""
    theirs = record.get("worker_host")
    return (record.get("status") == "running" and theirs not in (None, me)
            and not later_attempt(me, theirs))


def lost(kind: str, job_id: int) -> int:
    """The end of a job that stalled past its lease, whose row was given to another job since: that job reports it."""
    print(f"[plab] {kind} {job_id}: this job's lease lapsed and the {kind} was given to another job; this job stops "
          "unreported", flush=True)
    return EXIT_SKIPPED


def claimed(report: Callable[[], object], kind: str, job_id: int) -> bool:
    """`report()` is the job's `running` report with its holder (the claim); False when the API refused it (409:
    another job holds the row, so this message is a second copy of its job, or the row has ended), which the job
    answers by stopping unreported."""
    try:
        report()
    except ApiError as e:
        if e.status != 409:
            raise
        print(f"[plab] {kind} {job_id}: {e}; this job stops", flush=True)
        return False
    return True


def child_command(module: str, job_id: int) -> list[str]:
    return [sys.executable, "-m", module, str(job_id)]


def error_message(exc: BaseException) -> str:
    """What a failed row shows: the exception and the end of its traceback, within the API's 100,000 characters;
    for an error in what the user gave (the spec, the corpus, a recipe's options: training.launch.INPUT_ERRORS),
    whose message says what to fix, the message alone."""
    if _input_error(exc):
        return f"{type(exc).__name__}: {exc}"[:100_000]
    tb = "".join(traceback.format_exception(exc)[-6:])
    return f"{type(exc).__name__}: {exc}\n\n{tb}"[:100_000]


def _input_error(exc: BaseException) -> bool:
    launch = sys.modules.get("training.launch")  # a job that got this far has imported it; the worker need not
    return launch is not None and isinstance(exc, launch.INPUT_ERRORS)


def child_main(run: Callable[[int], int], module: str, argv: list[str] | None = None) -> int:
    """`python -m workers.jobs.<kind> ID`: run one job, return its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        sys.exit(f"usage: python -m {module} ID")
    return run(int(argv[0]))
