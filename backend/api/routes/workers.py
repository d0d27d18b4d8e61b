"""Workers register themselves (`plab worker` does, every PLAB_WORKER_BEAT_S) so that the API can refuse a run no
live worker of its queue can place (backend/services/workers.py)."""
from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path
from pydantic import BaseModel, Field
from sqlalchemy import select

from backend.api.deps import WRITE, SessionDep
from backend.models import Worker
from backend.schemas import Strict, UtcDatetime
from backend.services import workers

router = APIRouter(prefix="/workers", tags=["workers"])

QueueName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$")]


class WorkerIn(Strict):
    queues: list[QueueName] = Field(min_length=1, max_length=32)
    slots: int = Field(ge=1, le=1024)
    gpus_per_slot: int = Field(ge=0, le=1024, description="GPUs of each slot (0: CPU slots)")
    launcher: Literal["local", "slurm"] = "local"


class WorkerOut(BaseModel):
    name: str
    queues: list[str]
    slots: int
    gpus_per_slot: int
    launcher: str
    last_seen: UtcDatetime
    live: bool


def _out(w, live_names) -> dict:
    return {"name": w.name, "queues": w.queues, "slots": w.slots, "gpus_per_slot": w.gpus_per_slot,
            "launcher": w.launcher, "last_seen": w.last_seen, "live": w.name in live_names}


@router.put("/{name}", response_model=WorkerOut, dependencies=WRITE)
def register_worker(session: SessionDep, body: WorkerIn,
                    name: str = Path(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.@:\-]+$")):
    """A worker describes itself (and is live for the next 90 s)."""
    w = workers.register(session, name, body.queues, body.slots, body.gpus_per_slot, body.launcher)
    return _out(w, {name})


@router.get("", response_model=list[WorkerOut])
def list_workers(session: SessionDep):
    """Every worker that ever registered, with whether it is live."""
    live_names = {w.name for w in workers.live(session)}
    return [_out(w, live_names) for w in session.scalars(select(Worker).order_by(Worker.name))]
