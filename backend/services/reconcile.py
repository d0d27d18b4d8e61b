"""The reconciler: the database is the source of truth for which jobs must run, the broker only carries them.

Every PLAB_RECONCILE_S (an API background thread, `start_reconciler`; several API replicas are safe: each pass
locks the rows it changes) it looks at the runs a worker should be training:
  * `running` with no heartbeat for PLAB_STALE_S (the job's worker died: SIGKILL, node lost): put back to
    `queued` and its job sent again – the job resumes from the run's last checkpoint – until the run has been
    started PLAB_MAX_ATTEMPTS times, then `failed` with the reason;
  * `queued` for longer than PLAB_REQUEUE_GRACE_S whose message the broker no longer holds (a Redis restart
    without persistence, a job that gave up while the API was down): its job sent again.
A job claims its run when it reports `running` (refused while another job's heartbeat is fresh), so a message
sent twice never trains a run twice at once. An API process rather than Celery beat: the API already owns the
database, and a beat process would be one more service to keep alive for the thing that keeps services alive.
"""
from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta, timezone

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from backend.db import transaction
from backend.models import Run, utcnow
from backend.services import dispatch

log = logging.getLogger(__name__)


def _aware(t: datetime | None) -> datetime | None:
    return None if t is None else (t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc))


def reconcile(session: Session, settings, message_present=None, now: datetime | None = None) -> dict:
    """One pass; returns what it did ({"requeued": [...], "failed": [...], "resent": [...]})."""
    from backend.queue import queue_for
    from plab.broker import message_present as broker_has

    message_present = message_present or broker_has
    now = now or utcnow()
    done = {"requeued": [], "failed": [], "resent": []}
    stale = now - timedelta(seconds=settings.stale_s)
    rows = session.scalars(select(Run).where(Run.status == "running", Run.external.is_(False),
                                             or_(Run.heartbeat_at.is_(None), Run.heartbeat_at < stale))
                           .with_for_update(skip_locked=True)).all()
    for run in rows:
        last = _aware(run.heartbeat_at) or _aware(run.started_at)
        if last is not None and last >= stale:
            continue
        if (run.attempts or 0) >= settings.max_attempts:
            run.status, run.finished_at = "failed", now
            run.error_message = (f"the job's worker stopped heartbeating (last heartbeat {last:%Y-%m-%d %H:%M:%S} "
                                 f"UTC) and the run was started {run.attempts} times (PLAB_MAX_ATTEMPTS)")
            done["failed"].append(run.id)
            continue
        run.status = "queued"
        if dispatch.resend_run(session, run):
            done["requeued"].append(run.id)
    grace = now - timedelta(seconds=settings.requeue_grace_s)
    rows = session.scalars(select(Run).where(Run.status == "queued", Run.external.is_(False),
                                             Run.cancel_requested.is_(False), Run.dispatch_id.is_not(None),
                                             Run.dispatched_at < grace)
                           .with_for_update(skip_locked=True)).all()
    for run in rows:
        present = message_present(run.dispatch_id, sorted({"default", queue_for(run.spec)}))
        if present is False and dispatch.resend_run(session, run):
            done["resent"].append(run.id)
    if any(done.values()):
        log.warning("reconciler: %s", done)
    return done


def start_reconciler(app) -> threading.Event | None:
    """The background pass every `settings.reconcile_s` (0: off); returns the event that stops it."""
    settings = app.state.settings
    if settings.reconcile_s <= 0:
        return None
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(settings.reconcile_s):
            try:
                with transaction(app.state.sessionmaker) as session:
                    reconcile(session, settings)
            except Exception:  # noqa: BLE001 - a database or broker hiccup: the next pass tries again
                log.exception("reconciler pass failed")

    threading.Thread(target=loop, name="plab-reconciler", daemon=True).start()
    return stop
