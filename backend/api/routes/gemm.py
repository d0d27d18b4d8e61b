"""GEMM benchmarks (issue 6): queue one on a worker, store one the CLI measured, read them, worker status."""
from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from backend.api.deps import ObjectId, get_session, require_write_token
from backend.models import GemmBenchmark
from backend.schemas import Page
from backend.services import gemm

router = APIRouter(prefix="/gemm-benchmarks", tags=["gemm-benchmarks"])
write = [Depends(require_write_token)]


class GemmBenchmarkCreate(BaseModel):
    """Exactly one of `request` (queued for a worker) or `result` (a finished benchmark, as the CLI posts it)."""

    model_config = ConfigDict(extra="forbid")
    request: dict[str, Any] | None = Field(
        None, description="keyword arguments of training.gemm.run_gemm_benchmark, e.g. "
                          '{"model": "1b", "micro_batch": 4, "seq_len": 2048, "formats": ["bf16", "fp8_tensorwise"]}')
    result: dict[str, Any] | None = Field(None, description="the dict run_gemm_benchmark returned")
    experiment_id: int | None = Field(None, ge=1, le=2**31 - 1)
    name: str = Field("", max_length=200)
    enqueue: bool = Field(True, description="with `request`: send it to a worker now")
    queue: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$",
                       description="the worker queue (e.g. h100, cpu) the job goes to")


class GemmStatusUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["running", "succeeded", "failed"]
    device_name: str | None = Field(None, max_length=200)
    error_message: str | None = Field(None, max_length=100_000)
    result: dict[str, Any] | None = None


class GemmBenchmarkOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    experiment_id: int | None
    name: str
    request: dict[str, Any]
    status: str
    device_name: str | None
    error_message: str | None
    created_at: datetime | None
    summary: dict[str, Any] = {}


class GemmBenchmarkDetail(GemmBenchmarkOut):
    result: dict[str, Any]


def _out(bench: GemmBenchmark, cls=GemmBenchmarkOut):
    out = cls.model_validate(bench)
    out.summary = gemm.summarize(bench.result or {})
    return out


@router.post("", status_code=201, response_model=GemmBenchmarkDetail, dependencies=write)
def create_benchmark(body: GemmBenchmarkCreate, session: Session = Depends(get_session, scope="function")):
    """Queue a benchmark (`request`, sent to a worker when `enqueue`) or store a finished `result`."""
    bench = gemm.create_benchmark(session, request=body.request, result=body.result,
                                  experiment_id=body.experiment_id, name=body.name)
    if body.request is not None and body.enqueue:
        # Committed before it is enqueued: a fast worker must find the row when it asks for it.
        session.commit()
        from backend.queue import enqueue_gemm

        try:
            enqueue_gemm(bench.id, body.queue)
        except Exception as e:  # noqa: BLE001 - a broker that is down must not leave a benchmark queued forever
            gemm.update_status(session, bench.id, status="failed",
                               error_message=f"could not be sent to the job queue: {type(e).__name__}: {e}")
            session.commit()
            raise HTTPException(status_code=503, detail=f"GEMM benchmark {bench.id} was stored but the job queue "
                                f"is unavailable ({type(e).__name__}); check PLAB_BROKER_URL and retry") from e
    return _out(bench, GemmBenchmarkDetail)


@router.get("", response_model=Page)
def list_benchmarks(experiment_id: int | None = Query(None, ge=1, le=2**31 - 1),
                    status: Literal["queued", "running", "succeeded", "failed"] | None = None,
                    limit: int = Query(50, ge=1, le=500), offset: int = Query(0, ge=0, le=2**31),
                    session: Session = Depends(get_session, scope="function")):
    """Newest first, without the full result (each item has a `summary`); GET /{id} has the result."""
    total, rows = gemm.list_benchmarks(session, experiment_id=experiment_id, status=status, limit=limit,
                                       offset=offset)
    return Page(total=total, items=[_out(b) for b in rows])


@router.get("/{benchmark_id}", response_model=GemmBenchmarkDetail)
def get_benchmark(benchmark_id: ObjectId, session: Session = Depends(get_session, scope="function")):
    return _out(gemm.get_benchmark(session, benchmark_id), GemmBenchmarkDetail)


@router.post("/{benchmark_id}/status", response_model=GemmBenchmarkOut, dependencies=write)
def update_status(benchmark_id: ObjectId, body: GemmStatusUpdate,
                  session: Session = Depends(get_session, scope="function")):
    """Worker-facing: `running`, then `succeeded` with the result or `failed` with a message."""
    return _out(gemm.update_status(session, benchmark_id, status=body.status, device_name=body.device_name,
                                   error_message=body.error_message, result=body.result))
