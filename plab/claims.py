"""Who holds a job's row: the `worker_host` a job's `running` report claims its run, evaluation or GEMM benchmark with.

Written by the worker side (`workers.jobs.holder`) and read by the API (`backend.services.leases`) and by the worker
that started the job (`workers.tasks.run_job`), so the format and its one rule live here, below both: a job started
by a worker names the message and its attempt, "host (task <id> attempt <n>)"; a job in Slurm names the Slurm job,
"slurm job <id> (node)"; otherwise the host alone.
"""
from __future__ import annotations

import re

_TASK_ATTEMPT = re.compile(r"\(task (\S+) attempt (\d+)\)$")


def worker_holder(host: str, attempt: str | None) -> str:
    """The holder of a job a worker started (`attempt`: "<message id> attempt <n>"), or of one run by hand."""
    return f"{host} (task {attempt})" if attempt else host


def later_attempt(claimant: str | None, holder: str | None) -> bool:
    """Whether `claimant` is a later attempt of the job message whose earlier attempt holds the row: a worker
    retries a message only after its child ended (killed: the OOM killer, a preempted host), so that child's lease is
    not another job's. A second delivery of the same attempt (a broker's redelivery while the first still runs) is
    not later."""
    mine, theirs = (_TASK_ATTEMPT.search(h or "") for h in (claimant, holder))
    return (mine is not None and theirs is not None and mine.group(1) == theirs.group(1)
            and int(mine.group(2)) > int(theirs.group(2)))
