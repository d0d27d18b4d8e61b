from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response, StreamingResponse
from pydantic import ValidationError

from backend.api.deps import WRITE, Holder, ObjectId, SessionDep, get_settings
from backend.schemas import (METRIC_INGEST, X_RANGE_DOC, ArtifactIn, ArtifactOut, HeartbeatOut, MetricBatchResult, Page,
                             RunCreate, RunDetail, RunInfoUpdate, RunOut, Series, SeriesQuery, Status, StatusUpdate,
                             Tag, metric_series)
from backend.services import artifacts, dispatch, housekeeping, runs
from plab.settings import Settings

router = APIRouter(prefix="/runs", tags=["runs"])


@router.get("", response_model=Page)
def list_runs(session: SessionDep, experiment_id: int | None = Query(None, ge=1, le=2**31 - 1),
              status: Status | None = Query(None, description="only runs in this status"),
              recipe: str | None = Query(None, max_length=32),
              q: str | None = Query(None, max_length=200, description="matches label, experiment name, message, "
                                                                       "recipe or tags"),
              tag: Tag | None = Query(None, description="only runs with this tag"),
              archived: bool = Query(False, description="list archived runs (or runs of archived experiments) "
                                                        "instead"),
              limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=2**31)):
    total, items = housekeeping.list_runs(session, experiment_id=experiment_id, status=status, recipe=recipe, q=q, tag=tag,
                                  archived=archived, limit=limit, offset=offset)
    return Page(total=total, items=[RunOut.model_validate(r) for r in items])


@router.post("", status_code=201, response_model=RunDetail, dependencies=WRITE)
def create_external_run(body: RunCreate, session: SessionDep):
    """A run logged from the user's own script (not trained by our workers)."""
    return RunDetail.model_validate(runs.create_external_run(session, body))


@router.get("/{run_id}", response_model=RunDetail)
def get_run(run_id: ObjectId, session: SessionDep):
    return RunDetail.model_validate(runs.get_run(session, run_id))


@router.delete("/{run_id}", status_code=204, dependencies=WRITE)
def delete_run(run_id: ObjectId, session: SessionDep, settings: Settings = Depends(get_settings)):
    """The run, its metrics, artifacts and evaluations, and its folder PLAB_HOME/runs/<id>. 409 while it is
    queued or running (cancel it first)."""
    housekeeping.delete_run(session, run_id, settings.home)
    return Response(status_code=204)


@router.post("/{run_id}/cancel", response_model=RunOut, dependencies=WRITE)
def cancel_run(run_id: ObjectId, session: SessionDep):
    return RunOut.model_validate(runs.cancel_run(session, run_id))


@router.post("/{run_id}/retry", response_model=RunDetail, dependencies=WRITE,
             responses={409: {"description": "the run is not failed or cancelled, diverged, or is record-only"},
                        422: {"description": "live workers serve the run's queue but none can place its job"},
                        503: {"description": "the job queue refused the job: the run is failed again"}})
def retry_run(run_id: ObjectId, session: SessionDep):
    """Send a failed or cancelled run to a worker again: it is `queued`, and its job resumes from the last
    checkpoint the run wrote (training.checkpoint_every; from step 0 when it wrote none), with its metrics so far
    kept. Its error message is cleared and its start count reset. A diverged run is refused: the same spec
    diverges again."""
    return RunDetail.model_validate(dispatch.retry_run(session, run_id))


@router.post("/{run_id}/status", response_model=RunOut, dependencies=WRITE)
def update_status(run_id: ObjectId, body: StatusUpdate, session: SessionDep, request: Request):
    """A worker's report. `running` starts (claims) the run: 409 while another job holds it (fresh heartbeat)."""
    stale_s = request.app.state.settings.stale_s
    return RunOut.model_validate(dispatch.record_run_status(session, run_id, body, stale_s))


@router.post("/{run_id}/heartbeat", response_model=HeartbeatOut, dependencies=WRITE)
def heartbeat(run_id: ObjectId, session: SessionDep, holder: Holder = None):
    """A running job renews its lease (every PLAB_HEARTBEAT_S); the answer says whether to stop: the run's status,
    whether its cancel was requested, and who holds it (a job that lost its lease while it was stalled, and whose
    run another job has claimed since, sees another holder and stops)."""
    run = runs.heartbeat(session, run_id, holder)
    return HeartbeatOut(status=run.status, cancel_requested=run.cancel_requested, worker_host=run.worker_host)


@router.patch("/{run_id}", response_model=RunOut, dependencies=WRITE)
def update_run_info(run_id: ObjectId, body: RunInfoUpdate, session: SessionDep):
    """Informational fields (conversion report, GEMM backend, device, summary) and the user's (label, tags, notes,
    `archived`) without a status change."""
    return RunOut.model_validate(housekeeping.update_run(session, run_id, body))


async def metric_batch(request: Request) -> dict[str, list[tuple]]:
    """The body, validated straight from its bytes in compiled code (FastAPI's own path parses with the json
    module and validates the Python objects: three times the cost for a 10,000-point batch)."""
    try:
        return metric_series(METRIC_INGEST.validate_json(await request.body()))
    except ValidationError as e:  # the locations without the union's tag ("series.series.0..." -> "series.0...")
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"][1:])} for err in e.errors()]) from None


@router.post("/{run_id}/metrics", response_model=MetricBatchResult, dependencies=WRITE,
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/MetricIngest"}}}}})
def ingest_metrics(series: Annotated[dict[str, list[tuple]], Depends(metric_batch)], run_id: ObjectId,
                   session: SessionDep):
    """Batch ingest, idempotent on (run, key, step). Two forms: `{"points": [{key, step, value, tokens,
    wall_time}, ...]}` (at most 10,000 points) or `{"series": [{"key": K, "points": [[step, value, tokens,
    wall_time], ...]}, ...]}` (the compact form the metric client sends; at most 10,000 points per key). A value or
    wall time that is not finite (NaN, Infinity) or beyond +-1e300 is stored as null. The body is read and validated
    before the session (and SQLite's write lock) is taken.

    409 once the run has ended (succeeded, failed, cancelled, diverged): send every point before the final status.
    A re-sent batch whose points are all stored already is still answered 200 (all duplicates)."""
    return runs.ingest_metrics(session, run_id, series, refuse_ended=True)


@router.get("/{run_id}/metrics")
def list_metric_keys(run_id: ObjectId, session: SessionDep):
    return runs.metric_keys(session, run_id)


@router.get("/{run_id}/numerics")
def read_numerics(run_id: ObjectId, session: SessionDep,
                  stat: str = Query("underflow_frac", pattern=r"^[a-z_]{1,40}$",
                                    description="underflow_frac, saturation_frac or snr_db"),
                  max_points: int = Query(300, ge=4, le=10_000)):
    """Every converted layer's numerics series of one statistic at once (the heatmap): {run_id, stat, layers:
    [{layer, step, value}]} in layer order."""
    return runs.run_numerics(session, run_id, stat, max_points)


@router.get("/{run_id}/metrics/{key:path}", response_model=Series)
def read_series(run_id: ObjectId, session: SessionDep, key: str = Path(max_length=200),
                max_points: int = Query(2000, ge=4, le=100_000),
                x: Literal["step", "tokens", "wall_time"] = Query("step"),
                x_min: float | None = Query(None, description=X_RANGE_DOC),
                x_max: float | None = Query(None, description=X_RANGE_DOC)):
    q = SeriesQuery(max_points=max_points, x=x, x_min=x_min, x_max=x_max)
    return runs.run_series(session, run_id, key, q)


@router.post("/{run_id}/artifacts", status_code=201, response_model=ArtifactOut, dependencies=WRITE)
def add_artifact(run_id: ObjectId, body: ArtifactIn, session: SessionDep):
    return ArtifactOut.model_validate(runs.add_artifact(session, run_id, body))


@router.get("/{run_id}/artifacts", response_model=list[ArtifactOut])
def list_artifacts(run_id: ObjectId, session: SessionDep):
    return [ArtifactOut.model_validate(a) for a in runs.list_artifacts(session, run_id)]


@router.get("/{run_id}/artifacts/{artifact_id}/download", response_class=StreamingResponse,
            responses={200: {"description": "the file, or a folder (a checkpoint) as an uncompressed tar",
                             "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                                         "application/x-tar": {"schema": {"type": "string", "format": "binary"}}}}})
def download_artifact(run_id: ObjectId, artifact_id: ObjectId, session: SessionDep,
                      settings: Settings = Depends(get_settings)):
    """Only what lies inside the run's folder (PLAB_HOME/runs/<id>) after links are followed: 403 for a path
    outside it, 404 when the file is gone (a run keeps only its newest checkpoints)."""
    runs.get_run(session, run_id)
    target = artifacts.confined_path(session, settings.home, run_id, artifact_id)
    if target.is_file():
        return FileResponse(target, media_type="application/octet-stream", filename=target.name)
    files = artifacts.folder_files(target, housekeeping.run_folder(settings.home, run_id))
    return StreamingResponse(artifacts.tar_stream(files), media_type="application/x-tar", headers={
        "Content-Disposition": f'attachment; filename="run-{run_id}-{target.name}.tar"'})
