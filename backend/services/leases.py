"""A worker job's lease: renewed by its heartbeats while it runs (evaluations, GEMM benchmarks; a run's lease has its
holder check in `runs.heartbeat`). The reconciler (`reconcile`) ends a job whose heartbeats stopped."""
from __future__ import annotations

from sqlalchemy.orm import Session

from backend.errors import NotFound
from backend.models import utcnow


def renew(session: Session, model, job_id: int, what: str):
    """The job's row with its lease renewed if it is running (locked, as a status report locks it)."""
    job = session.get(model, job_id, with_for_update=True)
    if job is None:
        raise NotFound(f"{what} {job_id} does not exist")
    if job.status == "running":
        job.heartbeat_at = utcnow()
    return job
