from __future__ import annotations

import json
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse

from backend.api.deps import WRITE, ObjectId, SessionDep, get_settings
from backend.schemas import (X_RANGE_DOC, ExperimentCreate, ExperimentOut, ExperimentUpdate, Page, SeriesQuery, Tag,
                             VerdictOut)
from backend.services import comparison, dispatch, export, housekeeping, runs, verdict
from plab.settings import Settings

router = APIRouter(prefix="/experiments", tags=["experiments"])


@router.post("", status_code=201, response_model=ExperimentOut, dependencies=WRITE)
def create_experiment(body: ExperimentCreate, session: SessionDep):
    return ExperimentOut.model_validate(dispatch.submit_experiment(session, body))


@router.get("", response_model=Page)
def list_experiments(session: SessionDep, limit: int = Query(50, ge=1, le=500),
                     offset: int = Query(0, ge=0, le=2**31),
                     q: str | None = Query(None, max_length=200,
                                           description="matches name, description, tags, recipes or model"),
                     tag: Tag | None = Query(None, description="only experiments with this tag"),
                     archived: bool = Query(False, description="list the archived experiments instead")):
    total, items = housekeeping.list_experiments(session, limit=limit, offset=offset, q=q, tag=tag,
                                                 archived=archived)
    return Page(total=total, items=[ExperimentOut.model_validate(e) for e in items])


@router.get("/{experiment_id}", response_model=ExperimentOut)
def get_experiment(experiment_id: ObjectId, session: SessionDep):
    return ExperimentOut.model_validate(runs.get_experiment(session, experiment_id))


@router.patch("/{experiment_id}", response_model=ExperimentOut, dependencies=WRITE)
def update_experiment(experiment_id: ObjectId, body: ExperimentUpdate, session: SessionDep):
    """Name, description, tags, notes; `archived: true` hides it from the list (false restores it)."""
    return ExperimentOut.model_validate(housekeeping.update_experiment(session, experiment_id, body))


@router.delete("/{experiment_id}", status_code=204, dependencies=WRITE)
def delete_experiment(experiment_id: ObjectId, session: SessionDep, settings: Settings = Depends(get_settings)):
    """The experiment, every run's metrics, artifacts and evaluations, and the runs' folders under PLAB_HOME/runs.
    409 while a run is queued or running (cancel it first)."""
    housekeeping.delete_experiment(session, experiment_id, settings.home)
    return Response(status_code=204)


@router.get("/{experiment_id}/metrics")
def experiment_metric_keys(experiment_id: ObjectId, session: SessionDep):
    """Every metric key logged by any run of the experiment: {experiment_id, keys: [{key, runs, points}]}."""
    return runs.experiment_metric_keys(session, experiment_id)


EXPORT_TYPES = {"csv": "text/csv; charset=utf-8", "json": "application/json"}


@router.get("/{experiment_id}/export", response_class=StreamingResponse,
            responses={200: {"description": "every stored point, streamed (CSV columns: "
                                            + ", ".join(export.CSV_COLUMNS) + ")",
                             "content": {"text/csv": {"schema": {"type": "string"}},
                                         "application/json": {"schema": {"type": "object"}}}}})
def export_experiment(experiment_id: ObjectId, session: SessionDep, request: Request,
                      format: Literal["csv", "json"] = Query("csv"),
                      keys: str | None = Query(None, max_length=2000,
                                               description="comma-separated metric keys; all keys when left out")):
    """Every point of every series of every run at full resolution (not downsampled, not limited to a zoom)."""
    plan = export.export_plan(session, experiment_id)
    key_list = [k for k in (s.strip() for s in (keys or "").split(",")) if k] or None
    stream = (export.csv_stream if format == "csv" else export.json_stream)(
        request.app.state.sessionmaker, plan, key_list)
    return StreamingResponse(stream, media_type=EXPORT_TYPES[format], headers={
        "Content-Disposition": f'attachment; filename="experiment-{experiment_id}.{format}"'})


@router.get("/{experiment_id}/series")
def experiment_series(experiment_id: ObjectId, session: SessionDep,
                      keys: str = Query("train/loss", max_length=2000,
                                        description="comma-separated metric keys"),
                      max_points: int = Query(2000, ge=4, le=100_000), x: Literal["step", "tokens", "wall_time"] = Query("step"),
                      x_min: float | None = Query(None, description=X_RANGE_DOC),
                      x_max: float | None = Query(None, description=X_RANGE_DOC)):
    """Every run's series for the given keys, downsampled on the server from pre-computed min/max buckets
    (a one-step spike survives any zoom). An unknown key is an empty series."""
    q = SeriesQuery(max_points=max_points, x=x, x_min=x_min, x_max=x_max)
    key_list = [k for k in (s.strip() for s in keys.split(",")) if k]
    answer = runs.experiment_series(session, experiment_id, key_list, q)
    # Serialised here: FastAPI's generic encoder walks every one of the ~10^5 numbers and costs more than
    # the database's work on long experiments. Values are finite or None by construction (ingest stores NULL).
    return Response(content=json.dumps(answer, separators=(",", ":"), allow_nan=False),
                    media_type="application/json")


@router.get("/{experiment_id}/comparison")
def experiment_comparison(experiment_id: ObjectId, session: SessionDep,
                          key: str = Query("train/loss", min_length=1, max_length=200),
                          x: Literal["tokens", "step"] = Query("tokens"),
                          max_points: int = Query(2000, ge=2, le=100_000),
                          final_n: int = Query(20, ge=1, le=10_000,
                                               description="final loss = mean of the last final_n points")):
    """Relative difference of `key` to the BF16 run in percent, `100 * (run - bf16) / bf16`, at BF16's points
    (the other run interpolated linearly on tokens or steps), plus per run: final loss, final difference,
    tokens/s, speedup over BF16, MFU, peak memory and GEMM backend (emulated runs flagged).
    409 when the experiment has no BF16 run; an unknown key gives empty curves."""
    return comparison.compare_experiment(session, experiment_id, key=key, x=x, max_points=max_points,
                                         final_n=final_n)


@router.get("/{experiment_id}/verdict", response_model=VerdictOut)
def experiment_verdict(experiment_id: ObjectId, session: SessionDep):
    """Per recipe: final (and lowest) validation-loss difference to BF16, speedup (a value < 1 is a slowdown),
    accuracy differences (paired, Holm-corrected) and real/emulated GEMMs, and whether it matches BF16 by the rule
    named in `rule`: inside BF16's seed band when BF16 has seed replicates (the 95% two-sample t interval from
    BF16's seed-to-seed spread), else within the experiment's `verdict_tolerance_pct`. `summary` is the one-line verdict the dashboard and `plab demo` print."""
    return verdict.experiment_verdict(session, experiment_id)
