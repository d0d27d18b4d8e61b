from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from sqlalchemy.orm import Session

from backend import queue
from backend.api.deps import ObjectId, get_session, require_write_token
from backend.schemas import ExperimentCreate, ExperimentOut, Page, SeriesQuery
from backend.services import metrics, runs

router = APIRouter(prefix="/experiments", tags=["experiments"])


@router.post("", status_code=201, response_model=ExperimentOut, dependencies=[Depends(require_write_token)])
def create_experiment(body: ExperimentCreate, session: Session = Depends(get_session, scope="function")):
    exp = runs.create_experiment(session, body)
    session.commit()
    if body.enqueue:
        for run in exp.runs:
            queue.enqueue_train(run.id, run.spec)
    return ExperimentOut.model_validate(exp)


@router.get("", response_model=Page)
def list_experiments(limit: int = Query(50, ge=1, le=500), offset: int = Query(0, ge=0, le=2**31),
                     session: Session = Depends(get_session, scope="function")):
    total, items = runs.list_experiments(session, limit, offset)
    return Page(total=total, items=[ExperimentOut.model_validate(e) for e in items])


@router.get("/{experiment_id}", response_model=ExperimentOut)
def get_experiment(experiment_id: ObjectId, session: Session = Depends(get_session, scope="function")):
    return ExperimentOut.model_validate(runs.get_experiment(session, experiment_id))


@router.get("/{experiment_id}/series")
def experiment_series(experiment_id: ObjectId,
                      keys: str = Query("train/loss", max_length=2000,
                                        description="comma-separated metric keys"),
                      max_points: int = Query(2000, ge=4, le=100_000), x: str = Query("step"),
                      x_min: float | None = None, x_max: float | None = None,
                      session: Session = Depends(get_session, scope="function")):
    """Every run's series for the given keys, downsampled on the server (min/max buckets)."""
    q = SeriesQuery(max_points=max_points, x=x, x_min=x_min, x_max=x_max)
    exp = runs.get_experiment(session, experiment_id)
    key_list = [k for k in (s.strip() for s in keys.split(",")) if k]
    out = []
    for run in exp.runs:
        series = {k: metrics.read_series(session, run.id, k, max_points=q.max_points, x=q.x, x_min=q.x_min,
                                         x_max=q.x_max).model_dump(exclude={"key"}) for k in key_list}
        out.append({"run_id": run.id, "recipe": run.recipe, "label": run.label, "status": run.status,
                    "gemm_backend": run.gemm_backend, "series": series})
    return {"experiment_id": exp.id, "x": q.x, "keys": key_list, "runs": out}
