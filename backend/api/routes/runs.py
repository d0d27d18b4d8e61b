from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query
from sqlalchemy.orm import Session

from backend.api.deps import ObjectId, get_session, require_write_token
from backend.schemas import (ArtifactIn, ArtifactOut, MetricBatch, MetricBatchResult, Page, RunCreate, RunDetail,
                             RunInfoUpdate, RunOut, Series, SeriesQuery, StatusUpdate)
from backend import queue
from backend.services import evaluations, metrics, runs

router = APIRouter(prefix="/runs", tags=["runs"])
write = [Depends(require_write_token)]


@router.get("", response_model=Page)
def list_runs(experiment_id: int | None = Query(None, ge=1, le=2**31), status: str | None = Query(None, max_length=16),
              recipe: str | None = Query(None, max_length=32), q: str | None = Query(None, max_length=200),
              limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=2**31),
              session: Session = Depends(get_session, scope="function")):
    total, items = runs.list_runs(session, experiment_id=experiment_id, status=status, recipe=recipe, q=q,
                                  limit=limit, offset=offset)
    return Page(total=total, items=[RunOut.model_validate(r) for r in items])


@router.post("", status_code=201, response_model=RunDetail, dependencies=write)
def create_external_run(body: RunCreate, session: Session = Depends(get_session, scope="function")):
    """A run logged from the user's own script (not trained by our workers)."""
    return RunDetail.model_validate(runs.create_external_run(session, body))


@router.get("/{run_id}", response_model=RunDetail)
def get_run(run_id: ObjectId, session: Session = Depends(get_session, scope="function")):
    return RunDetail.model_validate(runs.get_run(session, run_id))


@router.post("/{run_id}/cancel", response_model=RunOut, dependencies=write)
def cancel_run(run_id: ObjectId, session: Session = Depends(get_session, scope="function")):
    return RunOut.model_validate(runs.cancel_run(session, run_id))


@router.post("/{run_id}/status", response_model=RunOut, dependencies=write)
def update_status(run_id: ObjectId, body: StatusUpdate, session: Session = Depends(get_session, scope="function")):
    run = runs.update_status(session, run_id, body)
    tasks = run.experiment.eval_tasks if body.status == "succeeded" and not run.external else []
    if tasks and evaluations.checkpoint_of(session, run.id):
        # The experiment's `eval_tasks`: every run is evaluated as soon as its training succeeds.
        ev = evaluations.create_evaluation(session, run.id, list(tasks), None)
        session.commit()
        queue.enqueue_eval(ev.id)
    return RunOut.model_validate(run)


@router.patch("/{run_id}", response_model=RunOut, dependencies=write)
def update_run_info(run_id: ObjectId, body: RunInfoUpdate, session: Session = Depends(get_session, scope="function")):
    """Informational fields (conversion report, GEMM backend, device, summary) without a status change."""
    return RunOut.model_validate(runs.update_info(session, run_id, body))


@router.post("/{run_id}/metrics", response_model=MetricBatchResult, dependencies=write)
def ingest_metrics(run_id: ObjectId, body: MetricBatch, session: Session = Depends(get_session, scope="function")):
    """Batch ingest, at most 10,000 points; idempotent on (run, key, step)."""
    run = runs.get_run(session, run_id)
    inserted, duplicates = metrics.ingest(session, run_id, body.points)
    loss_steps = [p.step for p in body.points if p.key == "train/loss"]
    if loss_steps:
        total = (run.spec.get("training") or {}).get("steps")
        step = max(max(loss_steps), (run.progress or {}).get("step", -1))
        run.progress = {"step": step, "total": total}
    return MetricBatchResult(inserted=inserted, duplicates=duplicates, run_status=run.status,
                             cancel_requested=run.cancel_requested)


@router.get("/{run_id}/metrics")
def list_metric_keys(run_id: ObjectId, session: Session = Depends(get_session, scope="function")):
    runs.get_run(session, run_id)
    return {"run_id": run_id, "keys": metrics.metric_keys(session, run_id)}


@router.get("/{run_id}/metrics/{key:path}", response_model=Series)
def read_series(run_id: ObjectId, key: str = Path(max_length=200), max_points: int = Query(2000, ge=4, le=100_000),
                x: str = Query("step"), x_min: float | None = None, x_max: float | None = None,
                session: Session = Depends(get_session, scope="function")):
    q = SeriesQuery(max_points=max_points, x=x, x_min=x_min, x_max=x_max)
    runs.get_run(session, run_id)
    return metrics.read_series(session, run_id, key, max_points=q.max_points, x=q.x, x_min=q.x_min, x_max=q.x_max)


@router.post("/{run_id}/artifacts", status_code=201, response_model=ArtifactOut, dependencies=write)
def add_artifact(run_id: ObjectId, body: ArtifactIn, session: Session = Depends(get_session, scope="function")):
    return ArtifactOut.model_validate(runs.add_artifact(session, run_id, body))


@router.get("/{run_id}/artifacts", response_model=list[ArtifactOut])
def list_artifacts(run_id: ObjectId, session: Session = Depends(get_session, scope="function")):
    return [ArtifactOut.model_validate(a) for a in runs.list_artifacts(session, run_id)]
