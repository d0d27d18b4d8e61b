"""GEMM benchmarks: queue one on a worker, store one the CLI measured, read them, worker status."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request

from backend.api.deps import WRITE, Holder, ObjectId, SessionDep
from backend.schemas import GemmBenchmarkCreate, GemmBenchmarkDetail, GemmBenchmarkOut, GemmStatusUpdate, Page
from backend.services import dispatch, gemm

router = APIRouter(prefix="/gemm-benchmarks", tags=["gemm-benchmarks"])


@router.post("", status_code=201, response_model=GemmBenchmarkDetail, dependencies=WRITE)
def create_benchmark(body: GemmBenchmarkCreate, session: SessionDep):
    """Queue a benchmark (`request`, sent to a worker when `enqueue`) or store a finished `result`."""
    return gemm.benchmark_out(dispatch.submit_gemm_benchmark(session, body), detail=True)


@router.get("", response_model=Page)
def list_benchmarks(session: SessionDep, experiment_id: int | None = Query(None, ge=1, le=2**31 - 1),
                    status: Literal["queued", "running", "succeeded", "failed"] | None = None,
                    limit: int = Query(50, ge=1, le=500), offset: int = Query(0, ge=0, le=2**31)):
    """Newest first, without the full result (each item has a `summary`); GET /{id} has the result."""
    total, rows = gemm.list_benchmarks(session, experiment_id=experiment_id, status=status, limit=limit,
                                       offset=offset)
    return Page(total=total, items=[gemm.benchmark_out(b) for b in rows])


@router.get("/{benchmark_id}", response_model=GemmBenchmarkDetail)
def get_benchmark(benchmark_id: ObjectId, session: SessionDep):
    return gemm.benchmark_out(gemm.get_benchmark(session, benchmark_id), detail=True)


@router.post("/{benchmark_id}/heartbeat", response_model=GemmBenchmarkOut, dependencies=WRITE)
def heartbeat(benchmark_id: ObjectId, session: SessionDep, holder: Holder = None):
    """A running benchmark's job renews its lease (worker-facing): the API's reconciler sends a benchmark whose
    heartbeats stop for PLAB_STALE_S (its worker died) again, and fails it after PLAB_MAX_ATTEMPTS starts."""
    return gemm.benchmark_out(gemm.heartbeat(session, benchmark_id, holder))


@router.post("/{benchmark_id}/status", response_model=GemmBenchmarkOut, dependencies=WRITE)
def update_status(benchmark_id: ObjectId, body: GemmStatusUpdate, session: SessionDep, request: Request):
    """Worker-facing: `running` (which claims the benchmark for its job: 409 while another job holds it), then
    `succeeded` with the result or `failed` with a message."""
    return gemm.benchmark_out(gemm.update_status(session, benchmark_id, status=body.status,
                                                 device_name=body.device_name, error_message=body.error_message,
                                                 result=body.result, worker_host=body.worker_host,
                                                 stale_s=request.app.state.settings.stale_s))
