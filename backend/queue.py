"""Enqueueing jobs for the workers (the API never imports the training code)."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def queue_for(spec: dict) -> str:
    """Jobs go to the queue of the hardware they ask for (`training.queue`, e.g. "h100", "cpu"), else "default"."""
    return str((spec.get("training") or {}).get("queue") or "default")


def enqueue_train(run_id: int, spec: dict) -> None:
    from workers.celery_app import app

    app.send_task("workers.tasks.train_run", args=[run_id], queue=queue_for(spec))


def enqueue_eval(evaluation_id: int) -> None:
    from workers.celery_app import app

    app.send_task("workers.tasks.evaluate_run", args=[evaluation_id], queue="default")


def enqueue_gemm(benchmark_id: int, queue: str = "default") -> None:
    from workers.celery_app import app

    app.send_task("workers.tasks.gemm_bench", args=[benchmark_id], queue=queue)
