"""The workers the API knows of (they register themselves) and the one rule that uses them: a run must fit a
live worker of its queue - `training.gpus` processes on one slot, or several nodes on a Slurm worker. With no
live worker on the queue the run is accepted and waits (workers may start later); with live workers of which
none can place it, the request is refused (422) naming what they offer, instead of failing after the queue."""
from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.errors import InvalidInput
from backend.models import Worker, utcnow
from backend.services.runs import _aware

LIVE_S = 90.0  # a worker that has not registered for this long is not counted


def register(session: Session, name: str, queues: list[str], slots: int, gpus_per_slot: int, launcher: str) -> Worker:
    worker = session.get(Worker, name)
    if worker is None:
        worker = Worker(name=name)
        session.add(worker)
    worker.queues, worker.slots, worker.gpus_per_slot, worker.launcher = queues, slots, gpus_per_slot, launcher
    worker.last_seen = utcnow()
    session.flush()
    return worker


def live(session: Session) -> list[Worker]:
    since = utcnow() - timedelta(seconds=LIVE_S)
    rows = session.scalars(select(Worker).order_by(Worker.name)).all()
    return [w for w in rows if _aware(w.last_seen) >= since]


def can_place(worker: Worker, gpus: int, nodes: int) -> bool:
    if worker.launcher == "slurm":
        return True  # the cluster decides; its pending reason is shown on the run
    if nodes > 1:
        return False
    return gpus <= max(worker.gpus_per_slot, 1)


def check_placement(session: Session, spec: dict, retry_of: int | None = None) -> None:
    """InvalidInput when live workers serve the spec's queue and none of them can run it (for the retry of run
    `retry_of`, whose spec stays as it is, the advice is a worker that can)."""
    training = spec.get("training") or {}
    queue = str(training.get("queue") or "default")
    gpus, nodes = int(training.get("gpus") or 1), int(training.get("nodes") or 1)
    serving = [w for w in live(session) if queue in (w.queues or [])]
    if not serving or any(can_place(w, gpus, nodes) for w in serving):
        return
    offers = "; ".join(f"{w.name}: {w.gpus_per_slot or 'CPU'} {'GPUs' if w.gpus_per_slot else 'slots'} per job "
                       f"({w.launcher})" for w in serving)
    need = f"{gpus} GPUs" + (f" on each of {nodes} nodes" if nodes > 1 else "")
    if retry_of is not None:
        raise InvalidInput(f"run {retry_of} is not retried: no live worker on queue '{queue}' can run a job on {need} "
                           f"(its training.gpus/nodes): {offers}. Start a worker that offers it (`plab worker --gpus "
                           f"... --multi-gpu`, or `--launcher slurm` for several nodes), then retry it")
    raise InvalidInput(f"no live worker on queue '{queue}' can run a job on {need} (training.gpus/nodes): {offers}. "
                       f"Lower training.gpus, send it to another queue (training.queue), or start a worker that "
                       f"offers it (`plab worker --gpus ... --multi-gpu`, or `--launcher slurm` for several nodes)")
