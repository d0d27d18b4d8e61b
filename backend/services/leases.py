"""A worker job's claim and lease, one rule for every kind of job (runs, evaluations, GEMM benchmarks).

A job starts its row by reporting `running` with its `worker_host` (`plab.claims`: the host, and the job message's id
and attempt). That claim is refused (409) while another job holds the row (a heartbeat younger than
PLAB_STALE_S), so a message delivered twice - a broker's redelivery while the first copy still runs, or the
reconciler's re-send of a message that was only starting - never runs one job twice at once. The holder renews its
lease with heartbeats; a job that names itself renews only its own lease and is told who holds the row. The
reconciler (`reconcile`) takes back a job whose heartbeats stopped and sends it again, up to PLAB_MAX_ATTEMPTS
starts."""
from __future__ import annotations

from datetime import timezone

from sqlalchemy.orm import Session

from backend.errors import Conflict, NotFound
from backend.models import utcnow
from plab.claims import later_attempt

def held_by_another(job, stale_s: float, claimant: str | None) -> float | None:
    """The age in seconds of the lease another job holds on `job` (a row with status, heartbeat_at, worker_host),
    which `claimant` may not take over; None when it may claim the row."""
    if job.status != "running" or job.heartbeat_at is None or later_attempt(claimant, job.worker_host):
        return None
    beat = job.heartbeat_at if job.heartbeat_at.tzinfo is not None else job.heartbeat_at.replace(tzinfo=timezone.utc)
    age = (utcnow() - beat).total_seconds()
    return age if age < stale_s else None


def claim(job, stale_s: float, claimant: str | None, what: str) -> None:
    """`job` started by the job `claimant` (a `running` report): refused while another job holds it; else it holds
    the row, with a fresh lease, and the start is counted (the reconciler sends a job whose worker died again until
    PLAB_MAX_ATTEMPTS starts)."""
    age = held_by_another(job, stale_s, claimant)
    if age is not None:
        raise Conflict(f"{what} {job.id} is being run by another job (last heartbeat {age:.0f} s ago): this "
                       "message is a second copy of its job, which stops")
    job.worker_host = claimant[:200] if claimant else None
    job.heartbeat_at = utcnow()
    job.attempts = (job.attempts or 0) + 1


def renew(session: Session, model, job_id: int, what: str, holder: str | None = None):
    """The job's row with its lease renewed if it is running (locked, as a status report locks it). A job naming
    itself (`holder`, its claim's worker_host) renews only its own lease: a job stalled past its lease (SIGSTOP, a
    frozen host) whose row another job has claimed since would keep that job's lease fresh, and its death would go
    unnoticed; the answer (the row, with its worker_host) tells it that it lost the row."""
    job = session.get(model, job_id, with_for_update=True)
    if job is None:
        raise NotFound(f"{what} {job_id} does not exist")
    if job.status == "running" and (holder is None or job.worker_host is None or holder == job.worker_host):
        job.heartbeat_at = utcnow()
    return job
