"""Celery tasks. Each job runs in a child process pinned to this pool slot's GPU(s)."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

from celery.signals import worker_process_init
from celery.utils.log import get_task_logger

from workers.celery_app import app

log = get_task_logger(__name__)
SLOT_ENV = "PLAB_SLOT_DEVICES"  # set per pool process: the CUDA_VISIBLE_DEVICES value of that slot


@worker_process_init.connect
def _pin_slot(**_kw) -> None:
    """Give each pool process its own device(s): slot i of `plab worker --gpus 0,1,...` gets GPU i."""
    from billiard.process import current_process

    slots = [s for s in os.environ.get("PLAB_WORKER_SLOTS", "").split(";") if s]
    if not slots:
        return
    index = getattr(current_process(), "index", 0) or 0
    os.environ[SLOT_ENV] = slots[index % len(slots)]


def _die_with_parent() -> None:
    # If the pool process running this job is killed, the job must not train on as an orphan.
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def job_command(run_id: int, gpus: int) -> list[str]:
    if gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                "-m", "workers.job", str(run_id)]
    return [sys.executable, "-m", "workers.job", str(run_id)]


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    devices = os.environ.get(SLOT_ENV)
    if devices is not None:
        if devices == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        else:
            env["CUDA_VISIBLE_DEVICES"] = devices
    threads = os.environ.get("PLAB_JOB_THREADS")
    if threads:
        env.setdefault("OMP_NUM_THREADS", threads)
    return env


@app.task(name="workers.tasks.train_run", bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=3)
def train_run(self, run_id: int) -> int:
    """Train one run. A job killed by a signal (worker death, OOM) is retried and resumes from its checkpoint."""
    from workers.client import PlabClient
    from backend.settings import get_settings

    settings = get_settings()
    run = PlabClient(settings.api_url, settings.api_token).get_run(run_id)
    gpus = int((run.get("spec", {}).get("training") or {}).get("gpus") or 1)
    log.info("run %s: starting job (%s GPU(s)), attempt %s", run_id, gpus, self.request.retries + 1)
    proc = subprocess.run(job_command(run_id, gpus), env=job_env(), preexec_fn=_die_with_parent)
    if proc.returncode < 0:
        log.warning("run %s: job killed by signal %s; retrying", run_id, -proc.returncode)
        raise self.retry(countdown=1)
    return proc.returncode


@app.task(name="workers.tasks.evaluate_run", bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=2)
def evaluate_run(self, evaluation_id: int) -> int:
    """lm-eval on a run's checkpoint, in a child process on this slot's device."""
    proc = subprocess.run([sys.executable, "-m", "workers.job", "eval", str(evaluation_id)], env=job_env(),
                          preexec_fn=_die_with_parent)
    if proc.returncode < 0:
        raise self.retry(countdown=1)
    return proc.returncode
