"""The GEMM benchmark job: one stored benchmark request, in its own process.

    python -m workers.jobs.gemm BENCHMARK_ID

The child fetches the stored request through the API, runs `training.gemm.run_gemm_benchmark(**request)` on
the GPU this pool slot owns, and posts `running`, then `succeeded` with the result or `failed` with the error.
A child process gives each benchmark a clean CUDA context, so a kernel that corrupts it or runs out of memory
cannot take the worker down.
"""
from __future__ import annotations

import sys

from plab.settings import get_settings
from workers.client import PlabClient
from workers.jobs import (EXIT_OK, EXIT_SKIPPED, UNREPORTED, child_command, child_main, claimed, error_message,
                          holder, lost)
from workers.jobs.lease import Heartbeat

KIND = "benchmark"
MODULE = "workers.jobs.gemm"


def command(benchmark_id: int) -> list[str]:
    return child_command(MODULE, benchmark_id)


def record(client: PlabClient, benchmark_id: int) -> dict:
    return client.get_gemm_benchmark(benchmark_id)


def status(client: PlabClient, benchmark_id: int) -> str:
    return record(client, benchmark_id)["status"]


def mark_failed(client: PlabClient, benchmark_id: int, message: str) -> None:
    client.set_gemm_status(benchmark_id, "failed", error_message=message)


def run(benchmark_id: int) -> int:
    from training.gemm import run_gemm_benchmark

    with PlabClient.from_env() as client:
        bench = client.get_gemm_benchmark(benchmark_id)
        if bench["status"] not in UNREPORTED:
            print(f"[plab] GEMM benchmark {benchmark_id} is '{bench['status']}'; nothing to do")
            return EXIT_SKIPPED
        me = holder()
        if not claimed(lambda: client.set_gemm_status(benchmark_id, "running", worker_host=me), KIND, benchmark_id):
            return EXIT_SKIPPED
        beat = Heartbeat(client, benchmark_id, get_settings().heartbeat_s, holder=me, beat=client.gemm_heartbeat)
        try:
            result = run_gemm_benchmark(**bench["request"],
                                        progress=lambda msg: print(f"[plab] timing {msg}", flush=True))
        except BaseException as e:  # noqa: BLE001 - every failure is reported, then re-raised as an exit code
            beat.stop()
            if beat.lost:
                return lost(KIND, benchmark_id)
            client.set_gemm_status(benchmark_id, "failed", error_message=error_message(e))
            raise
        beat.stop()
        if beat.lost:
            return lost(KIND, benchmark_id)
        client.set_gemm_status(benchmark_id, "succeeded", result=result, device_name=result["device"]["name"])
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(child_main(run, MODULE))
