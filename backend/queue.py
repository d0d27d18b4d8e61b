"""Enqueueing jobs for the workers: messages by task name through `plab.broker`, so the API imports neither
workers/ nor the training code."""
from __future__ import annotations

from datetime import datetime

from plab.broker import EVALUATE_TASK, GEMM_TASK, TRAIN_TASK, send_task, train_gpus


def queue_for(spec: dict) -> str:
    """Jobs go to the queue of the hardware they ask for (`training.queue`, e.g. "h100", "cpu"), else "default"."""
    return str((spec.get("training") or {}).get("queue") or "default")


def enqueue_train(run_id: int, spec: dict, dispatched_at: datetime) -> str:
    """Sends the run's job; returns the message id (kept on the run, so a lost message can be found out).
    `dispatched_at`, also stored as the run's `dispatched_at`, travels with the message: a worker skips a message
    older than the run's latest dispatch (workers.tasks.superseded)."""
    # The GPU count travels with the message: the worker picks torchrun or a single process without asking the API.
    nodes = int((spec.get("training") or {}).get("nodes") or 1)
    kwargs = {"gpus": train_gpus(spec), **({"nodes": nodes} if nodes > 1 else {}),
              "dispatched_at": dispatched_at.isoformat()}
    return send_task(TRAIN_TASK, [run_id], kwargs=kwargs, queue=queue_for(spec))


def enqueue_eval(evaluation_id: int, dispatched_at: datetime) -> str:
    """Sends the evaluation's job; returns the message id, kept with `dispatched_at` on the evaluation (as a run's)."""
    return send_task(EVALUATE_TASK, [evaluation_id], kwargs={"dispatched_at": dispatched_at.isoformat()},
                     queue="default")


def enqueue_gemm(benchmark_id: int, queue: str, dispatched_at: datetime) -> str:
    """Sends the GEMM benchmark's job to `queue`; returns the message id, kept with `dispatched_at` on the row."""
    return send_task(GEMM_TASK, [benchmark_id], kwargs={"dispatched_at": dispatched_at.isoformat()}, queue=queue)
