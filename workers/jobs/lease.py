"""A job's lease: the heartbeat thread every worker job runs while it works (training, evaluation, GEMM benchmark)."""
from __future__ import annotations

import threading

from workers.client import PlabClient


class Heartbeat:
    """Renews a job's lease every `interval` seconds from a thread while the job runs: the API's reconciler takes
    a job whose heartbeats stop (its worker died) back and sends it to another worker, up to PLAB_MAX_ATTEMPTS
    starts. `beat(job_id, holder)` is the request (a run's by default; `client.evaluation_heartbeat`,
    `client.gemm_heartbeat`)."""

    def __init__(self, client: PlabClient, run_id: int, interval: float, on_lost=None, on_cancel=None, beat=None,
                 holder: str | None = None):
        # a job names itself (its claim's worker_host): the answer then says whether it still holds its row
        self._holder = holder
        self._beat = beat or client.heartbeat  # called as beat(job_id, holder)
        self._on_cancel = on_cancel
        self.lost = False  # the API gave the run to another job (this one missed its heartbeats): stop, unreported
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(run_id, interval), daemon=True,
                                        name=f"plab-heartbeat-{run_id}")
        self._thread.start()

    def _loop(self, run_id: int, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                answer = self._beat(run_id, self._holder)
            except Exception as e:  # noqa: BLE001 - a missed beat is retried at the next interval
                print(f"[plab] heartbeat of job {run_id} failed: {e}", flush=True)
                continue
            if answer.get("cancel_requested") and self._on_cancel is not None:
                self._on_cancel()  # reaches the loop even while metric posts fail
            taken = (self._holder is not None and answer.get("status") == "running"
                     and answer.get("worker_host") not in (None, self._holder))  # claimed by another job since
            if answer.get("status") == "queued" or taken:  # the reconciler took the run back
                self.lost = True
                if self._on_lost is not None:
                    self._on_lost()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
