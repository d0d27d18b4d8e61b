"""Celery task for the GEMM benchmark (issue 6): one benchmark per job, in its own child process.

    python -m workers.gemm_tasks BENCHMARK_ID      # the child: what the task runs

The child fetches the stored request through the API, runs `training.gemm.run_gemm_benchmark(**request)` on
the GPU this pool slot owns (`job_env()`, as for training jobs), and posts `running`, then `succeeded` with the
result or `failed` with the error. A child process gives each benchmark a clean CUDA context, so a kernel
that corrupts it or runs out of memory cannot take the worker down.
"""
from __future__ import annotations

import subprocess
import sys
import traceback

from celery.utils.log import get_task_logger

from workers.celery_app import app
from workers.tasks import _die_with_parent, job_env

log = get_task_logger(__name__)
EXIT_OK, EXIT_SKIPPED = 0, 3


def _client():
    from backend.settings import get_settings
    from workers.client import PlabClient

    settings = get_settings()
    return PlabClient(settings.api_url, settings.api_token)


def job_command(benchmark_id: int) -> list[str]:
    return [sys.executable, "-m", "workers.gemm_tasks", str(benchmark_id)]


# Registered under the name backend.queue.enqueue_gemm sends (the task list of docs/INTERFACES.md).
@app.task(name="workers.tasks.gemm_bench", bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=1)
def gemm_bench(self, benchmark_id: int) -> int:
    """Run one stored GEMM benchmark in a child process; a child that dies without reporting is marked failed."""
    log.info("gemm benchmark %s: starting job, attempt %s", benchmark_id, self.request.retries + 1)
    proc = subprocess.run(job_command(benchmark_id), env=job_env(), preexec_fn=_die_with_parent)
    if proc.returncode in (EXIT_OK, EXIT_SKIPPED):
        return proc.returncode
    if proc.returncode < 0 and self.request.retries < self.max_retries:
        log.warning("gemm benchmark %s: job killed by signal %s; retrying", benchmark_id, -proc.returncode)
        raise self.retry(countdown=1)
    # The child reports its own exceptions; this covers a crash it could not report (segfault, OOM kill).
    with _client() as client:
        bench = client.get_gemm_benchmark(benchmark_id)
        if bench["status"] in ("queued", "running"):
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
            client.set_gemm_status(benchmark_id, "failed",
                                   error_message=f"the benchmark process ended without a result ({how})")
    return proc.returncode


def run_job(benchmark_id: int) -> int:
    """The child's work: fetch the request, run it, report the outcome. Returns the process exit code."""
    from training.gemm import run_gemm_benchmark

    with _client() as client:
        bench = client.get_gemm_benchmark(benchmark_id)
        if bench["status"] not in ("queued", "running"):
            print(f"[plab] GEMM benchmark {benchmark_id} is '{bench['status']}'; nothing to do")
            return EXIT_SKIPPED
        client.set_gemm_status(benchmark_id, "running")
        try:
            result = run_gemm_benchmark(**bench["request"],
                                        progress=lambda msg: print(f"[plab] timing {msg}", flush=True))
        except BaseException as e:  # noqa: BLE001 - every failure is reported, then re-raised as an exit code
            tb = "".join(traceback.format_exception(e)[-6:])
            client.set_gemm_status(benchmark_id, "failed", error_message=f"{type(e).__name__}: {e}\n\n{tb}"[:100_000])
            raise
        client.set_gemm_status(benchmark_id, "succeeded", result=result, device_name=result["device"]["name"])
    return EXIT_OK


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m workers.gemm_tasks BENCHMARK_ID")
    sys.exit(run_job(int(sys.argv[1])))
