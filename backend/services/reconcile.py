"""The reconciler: the database is the source of truth for which jobs must run, the broker only carries them.

Every PLAB_RECONCILE_S (an API background thread, `start_reconciler`; several API replicas are safe: each pass
locks the rows it changes) it looks at the runs a worker should be training:
  * `running` with no heartbeat for PLAB_STALE_S (the job's worker died: SIGKILL, node lost): put back to
    `queued` and its job sent again – the job resumes from the run's last checkpoint – until the run has been
    started PLAB_MAX_ATTEMPTS times, then `failed` with the reason;
  * `queued` for longer than PLAB_REQUEUE_GRACE_S whose message the broker no longer holds (a Redis restart
    without persistence, a job that gave up while the API was down; on the filesystem broker, a worker killed after
    it took the message): its job sent again. Queued evaluations and GEMM benchmarks likewise (before 2026-12-07
    theirs stayed `queued` for ever; until 2026-12-08 only on Redis).
A run whose cancel was requested is not sent again: a job skips such a run, which would then stay `queued` for
ever (and could not be deleted). `running` with a stale heartbeat, or `queued` with its message gone (or never
sent), it is marked `cancelled` instead.
An evaluation or GEMM benchmark `running` with no heartbeat for PLAB_STALE_S is taken back the same way: `queued`
and sent again (an evaluation's results so far stay; its new job scores every task again and replaces them), then
`failed` with the reason after PLAB_MAX_ATTEMPTS starts; one that was never sent through the queue (a row from
before its dispatch was recorded) is failed at once, saying how to start it again.
A job claims its row when it reports `running` (refused while another job's heartbeat is fresh: `leases`), so a
message sent twice never runs one job twice at once; a message re-sent while the first copy was only starting is
harmless. An API process rather than Celery beat: the API already owns the database,
and a beat process would be one more service to keep alive for the thing that keeps services alive.
"""
from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta, timezone

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from backend.db import transaction
from backend.models import Evaluation, GemmBenchmark, Run, utcnow
from backend.queue import queue_for
from backend.services import dispatch

log = logging.getLogger(__name__)


def _aware(t: datetime | None) -> datetime | None:
    return None if t is None else (t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc))


# A worker's job claims its row seconds after the worker takes its message (the job's process starts, imports, reports
# `running`); a message taken this many PLAB_STALE_S ago whose row is still `queued` lost its worker.
CLAIM_WAIT_STALES = 10


def reconcile(session: Session, settings, messages_present=None, now: datetime | None = None,
              taken_before=None) -> dict:
    """One pass; returns what it did ({"requeued": [...], "failed": [...], "resent": [...]}, and, when there were
    any, "cancelled" (runs whose cancel was requested), "evaluations_resent", "gemm_benchmarks_resent",
    "evaluations_requeued", "gemm_benchmarks_requeued", "evaluations_failed", "gemm_benchmarks_failed").

    No run stays locked while the broker is asked, nor while another run is handled: the candidates are read without
    locks, the broker is asked once about all the queued ones (`plab.broker.messages_present`, or the callable
    given), and each run to change is then locked on its own (SKIP LOCKED: one that a worker's request or another
    API replica holds is left to the next pass), checked again and committed. A worker's metric batch or status
    report, which lock their run, thus waits at most for that run's own change. Until 2026-11-29 a pass held every
    candidate locked while it asked the broker about each in turn; behind a slow broker the workers' requests
    waited (a metric batch timed out after 10 s in deeper OpenAPI fuzzing on PostgreSQL)."""
    from plab.broker import messages_present as broker_holds, taken_before as broker_took

    messages_present, taken_before = messages_present or broker_holds, taken_before or broker_took
    now = now or utcnow()
    done = {"requeued": [], "failed": [], "resent": []}
    stale = now - timedelta(seconds=settings.stale_s)
    silent = (Run.status == "running", Run.external.is_(False),
              or_(Run.heartbeat_at.is_(None), Run.heartbeat_at < stale))
    for rid in session.scalars(select(Run.id).where(*silent).order_by(Run.id)).all():
        run = session.scalars(select(Run).where(Run.id == rid, *silent).with_for_update(skip_locked=True)).first()
        last = None if run is None else (_aware(run.heartbeat_at) or _aware(run.started_at))
        if run is None or (last is not None and last >= stale):
            session.commit()
            continue
        if run.cancel_requested:
            # The job would skip it (its cancel was requested): sent again, it would stay queued for ever.
            _cancel(run, now, f"cancelled: the job's worker stopped heartbeating (last heartbeat "
                              f"{last:%Y-%m-%d %H:%M:%S} UTC) after the cancel was requested" if last else
                              "cancelled: the job's worker stopped heartbeating after the cancel was requested")
            done.setdefault("cancelled", []).append(run.id)
        elif (run.attempts or 0) >= settings.max_attempts:
            run.status, run.finished_at = "failed", now
            run.error_message = (f"the job's worker stopped heartbeating (last heartbeat {last:%Y-%m-%d %H:%M:%S} "
                                 f"UTC) and the run was started {run.attempts} times (PLAB_MAX_ATTEMPTS)")
            done["failed"].append(run.id)
        else:
            run.status = "queued"
            if dispatch.resend(session, run):
                done["requeued"].append(run.id)
        session.commit()
    grace = now - timedelta(seconds=settings.requeue_grace_s)
    unclaimed = now - timedelta(seconds=CLAIM_WAIT_STALES * settings.stale_s)
    _resend_lost(session, messages_present, grace, done, taken_before, unclaimed)
    _cancel_abandoned(session, messages_present, now, grace, done, taken_before, unclaimed)
    _take_back_silent_jobs(session, settings.max_attempts, now, stale, done)
    if any(done.values()):
        log.warning("reconciler: %s", done)
    return done


# What the lost-message pass looks at, per kind: the rows still waiting for a worker on a message sent before the grace
# period, the column that says which queue that message went to (and how), and the key of `done` listing those sent
# again. A run whose cancel was requested is left to _cancel_abandoned.
_WAITING = (
    (Run, (Run.external.is_(False), Run.cancel_requested.is_(False)), Run.spec, queue_for, "resent"),
    (Evaluation, (), Evaluation.id, lambda _id: "default", "evaluations_resent"),
    (GemmBenchmark, (), GemmBenchmark.queue, lambda name: name or "default", "gemm_benchmarks_resent"),
)


def _resend_lost(session: Session, messages_present, grace: datetime, done: dict, taken_before=None,
                 unclaimed: datetime | None = None) -> None:
    """Queued runs, evaluations and GEMM benchmarks whose message the broker no longer holds (neither waiting nor,
    where the broker shows them, delivered and unacknowledged) `grace` after it was sent: sent again. The broker is
    asked once about them all. On the filesystem broker a message missing from its queue may be one a worker has
    just taken. Then the two copies meet at the row: the first job to report `running` claims it and the other
    stops (`leases.claim`), or the first copy's worker, reading the row after the re-send, skips its older message
    (`workers.tasks.superseded`). One job runs either way.
    Also sent again: one whose message a worker took before `unclaimed` (Redis: `taken_before`) and whose row no
    job has claimed since - the worker died before the job's process reported `running` (a killed worker's message
    came back only after Redis's visibility timeout, 6 h, before 2026-12-08). Not a run a Slurm job stands for
    (`summary.slurm`): its worker's watcher holds the message while the cluster keeps the job pending."""
    candidates = []
    for model, where, column, queue_of, key in _WAITING:
        waiting = (model.status == "queued", *where, model.dispatch_id.is_not(None), model.dispatched_at < grace)
        rows = session.execute(select(model.id, model.dispatch_id, column).where(*waiting).order_by(model.id)).all()
        candidates += [(model, waiting, key, row_id, dispatch_id, queue_of(value))
                       for row_id, dispatch_id, value in rows]
    session.commit()  # the read's transaction ends before the broker is asked
    if not candidates:
        return
    held = messages_present({c[4] for c in candidates}, sorted({"default"} | {c[5] for c in candidates}))
    if held is None:  # a broker that cannot be asked: nothing is re-sent on its account
        return
    orphaned = _orphaned(session, [(c[0], c[3], c[4]) for c in candidates if c[4] in held], taken_before, unclaimed)
    for model, waiting, key, row_id, dispatch_id, _queue in candidates:
        if dispatch_id in held and dispatch_id not in orphaned:
            continue
        # Still queued on the same message (a worker that took it meanwhile has claimed the row: `running`).
        row = session.scalars(select(model).where(model.id == row_id, model.dispatch_id == dispatch_id, *waiting)
                              .with_for_update(skip_locked=True)).first()
        if row is not None and dispatch.resend(session, row):
            done.setdefault(key, []).append(row_id)
        session.commit()


def _orphaned(session: Session, taken: list, taken_before, unclaimed: datetime | None) -> set[str]:
    """The messages of `taken` ((model, row id, message id) of queued rows whose message the broker holds) that a
    worker took before `unclaimed` without its job claiming the row since, but those of runs a Slurm job stands
    for."""
    if not taken or taken_before is None or unclaimed is None:
        return set()
    old = taken_before({message for _, _, message in taken}, unclaimed.timestamp()) or set()
    run_ids = [row_id for model, row_id, message in taken if model is Run and message in old]
    if run_ids:
        summaries = session.execute(select(Run.id, Run.summary).where(Run.id.in_(run_ids))).all()
        session.commit()
        in_slurm = {rid for rid, summary in summaries if (summary or {}).get("slurm")}
        old -= {message for model, row_id, message in taken if model is Run and row_id in in_slurm}
    return old


def _take_back_silent_jobs(session: Session, max_attempts: int, now: datetime, stale: datetime, done: dict) -> None:
    """`running` evaluations and GEMM benchmarks whose job stopped heartbeating for PLAB_STALE_S (its worker was
    killed, its node lost): `queued` and sent again, as a run is, until started `max_attempts` times; then, or when
    the row was never sent through the queue, `failed` with the reason and how to start it again. Before 2026-12-08
    every such job was failed at once (and before they had heartbeats, stayed `running` for ever). One running
    since before they had heartbeats is judged by its creation time."""
    kinds = ((Evaluation, "evaluation", "evaluations",
              lambda ev: f"POST /api/v1/runs/{ev.run_id}/evaluations (plab eval {ev.run_id} --tasks ...)"),
             (GemmBenchmark, "GEMM benchmark", "gemm_benchmarks",
              lambda _bench: "POST /api/v1/gemm-benchmarks (plab gemm-bench)"))
    for model, what, key, again in kinds:
        silent = (model.status == "running",
                  or_(model.heartbeat_at < stale, model.heartbeat_at.is_(None) & (model.created_at < stale)))
        for jid in session.scalars(select(model.id).where(*silent).order_by(model.id)).all():
            job = session.scalars(select(model).where(model.id == jid, *silent)
                                  .with_for_update(skip_locked=True)).first()
            if job is None:
                session.commit()
                continue
            last = _aware(job.heartbeat_at)
            since = f" (last heartbeat {last:%Y-%m-%d %H:%M:%S} UTC)" if last else ""
            if job.dispatch_id is not None and (job.attempts or 0) < max_attempts:
                job.status, job.heartbeat_at = "queued", None
                if dispatch.resend(session, job):  # else queued on the lost message: re-sent by a later pass
                    done.setdefault(f"{key}_requeued", []).append(job.id)
            else:
                job.status = "failed"
                if model is Evaluation:  # a benchmark records no end time
                    job.finished_at = now
                started = (f" and it was started {job.attempts} times (PLAB_MAX_ATTEMPTS)"
                           if job.dispatch_id is not None else "")
                job.error_message = (f"the {what}'s worker stopped heartbeating{since}{started}; start it again "
                                     f"with {again(job)}")
                done.setdefault(f"{key}_failed", []).append(job.id)
            session.commit()


def _cancel(run: Run, now: datetime, message: str) -> None:
    run.status, run.finished_at = "cancelled", now
    if not run.error_message:
        run.error_message = message


def _cancel_abandoned(session: Session, messages_present, now: datetime, grace: datetime, done: dict,
                      taken_before=None, unclaimed: datetime | None = None) -> None:
    """`queued` runs whose cancel was requested and whose job message is gone (a job took it and skipped the run),
    was never sent, or was taken by a worker that died before its job started (`_orphaned`): nothing will start
    them (left so by this reconciler before 2026-12, which sent such a run again)."""
    abandoned = (Run.status == "queued", Run.external.is_(False), Run.cancel_requested.is_(True),
                 or_(Run.dispatch_id.is_(None), Run.dispatched_at.is_(None), Run.dispatched_at < grace))
    candidates = session.execute(select(Run.id, Run.dispatch_id, Run.spec).where(*abandoned).order_by(Run.id)).all()
    session.commit()  # the read's transaction ends before the broker is asked
    sent = [(rid, d, spec) for rid, d, spec in candidates if d is not None]
    held: set | None = set()
    if sent:
        held = messages_present({d for _, d, _ in sent}, sorted({"default"} | {queue_for(spec) for _, _, spec in sent}))
    if held is None:  # a broker that cannot be asked: only the runs never sent are certain to be abandoned
        held = {d for _, d, _ in sent}
    held = held - _orphaned(session, [(Run, rid, d) for rid, d, _ in sent if d in held], taken_before, unclaimed)
    for rid, dispatch_id, _ in candidates:
        if dispatch_id is not None and dispatch_id in held:
            continue  # a worker will take the message and skip the run; the next pass finds it gone
        same = Run.dispatch_id.is_(None) if dispatch_id is None else Run.dispatch_id == dispatch_id
        run = session.scalars(select(Run).where(Run.id == rid, same, *abandoned)
                              .with_for_update(skip_locked=True)).first()
        if run is not None:
            _cancel(run, now, "cancelled: the cancel was requested while the run waited for a worker, and its job "
                              "message is gone")
            done.setdefault("cancelled", []).append(rid)
        session.commit()


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
