"""HTTP client of the Precision Lab API, for our workers and for users logging runs from their own scripts.

    from workers.client import PlabClient
    client = PlabClient("http://localhost:8000", token=None)
    run = client.create_external_run(experiment_id=1, recipe="fp8_tensorwise")
    with client.stream(run["id"]) as stream:           # batches in a background thread
        for step in range(1000):
            stream.log(step, {"train/loss": loss}, tokens=step * 8192)
    client.set_status(run["id"], "succeeded")
"""
from __future__ import annotations

import json
import math
import os
import sys
import queue
import threading
import time
from collections.abc import Callable

import httpx
from pydantic_core import to_json

MAX_BATCH = 10_000
FINAL_STATUSES = ("succeeded", "failed", "cancelled", "diverged")  # a run's statuses after which it takes no metrics


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class PlabClient:
    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 30.0, retries: int = 5):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url + "/api/v1", headers=headers, timeout=timeout)
        self.retries = retries

    @classmethod
    def from_env(cls, api_url: str | None = None, **kw) -> PlabClient:
        """A client of the API named by PLAB_API_URL (or `api_url`), with PLAB_API_TOKEN for writes."""
        from plab.settings import get_settings

        settings = get_settings()
        return cls(api_url or settings.api_url, settings.api_token, **kw)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PlabClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, *, idempotent: bool = True, retries: int | None = None, **kw) -> dict:
        """A request with retries on connection errors and 5xx for idempotent calls (every write a worker makes
        is). A create (`idempotent=False`) is retried only when the connection was never made, so an answer lost
        after the server stored it cannot create a second experiment or run."""
        delay = 0.5
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                resp = self._http.request(method, path, **kw)
            except httpx.TransportError as exc:
                if attempt == retries or (not idempotent and not isinstance(exc, httpx.ConnectError)):
                    raise
            else:
                if resp.status_code < 500:
                    if resp.status_code >= 400:
                        try:
                            detail = resp.json().get("detail", resp.text)
                        except ValueError:
                            detail = resp.text
                        raise ApiError(resp.status_code, str(detail))
                    return resp.json()
                if attempt == retries or not idempotent:
                    raise ApiError(resp.status_code, resp.text)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    # experiments and runs
    def create_experiment(self, body: dict) -> dict:
        return self._request("POST", "/experiments", json=body, idempotent=False)

    def get_experiment(self, experiment_id: int) -> dict:
        return self._request("GET", f"/experiments/{experiment_id}")

    def get_verdict(self, experiment_id: int) -> dict:
        return self._request("GET", f"/experiments/{experiment_id}/verdict")

    def list_experiments(self, limit: int = 50) -> dict:
        return self._request("GET", "/experiments", params={"limit": limit})

    def get_run(self, run_id: int, *, retries: int | None = None) -> dict:
        return self._request("GET", f"/runs/{run_id}", retries=retries)

    def create_external_run(self, experiment_id: int, recipe: str = "bf16", recipe_options: dict | None = None,
                            label: str | None = None) -> dict:
        body = {"experiment_id": experiment_id, "recipe": recipe, "recipe_options": recipe_options or {}}
        if label:
            body["label"] = label
        return self._request("POST", "/runs", json=body, idempotent=False)

    def cancel_run(self, run_id: int) -> dict:
        return self._request("POST", f"/runs/{run_id}/cancel")

    def retry_run(self, run_id: int) -> dict:
        """A failed or cancelled run queued again (it resumes from its last checkpoint)."""
        return self._request("POST", f"/runs/{run_id}/retry", idempotent=False)

    def set_status(self, run_id: int, status: str, **fields) -> dict:
        body = {"status": status, **{k: v for k, v in fields.items() if v is not None}}
        return self._request("POST", f"/runs/{run_id}/status", json=body)

    def register_worker(self, name: str, queues: list[str], slots: int, gpus_per_slot: int, launcher: str) -> dict:
        return self._request("PUT", f"/workers/{name}", json={"queues": queues, "slots": slots,
                                                               "gpus_per_slot": gpus_per_slot, "launcher": launcher})

    def heartbeat(self, run_id: int, holder: str | None = None) -> dict:
        return self._request("POST", f"/runs/{run_id}/heartbeat", params={"holder": holder} if holder else None)

    def update_run(self, run_id: int, *, retries: int | None = None, **fields) -> dict:
        """Informational fields of a run (conversion report, GEMM backend, summary) without a status change."""
        return self._request("PATCH", f"/runs/{run_id}", json={k: v for k, v in fields.items() if v is not None},
                             retries=retries)

    def log_metrics(self, run_id: int, points: list[dict], *, retries: int | None = None) -> dict:
        """Send points ({key, step, value, tokens?, wall_time?} dicts) in batches of at most 10,000; safe to
        repeat (idempotent on run+key+step). They travel in the API's compact form (grouped by key, each point
        [step, value, tokens, wall_time]), serialized by pydantic-core: a third of the bytes of the row form and
        a tenth of the encoding time."""
        result = {"inserted": 0, "duplicates": 0}
        for i in range(0, len(points), MAX_BATCH):
            body = to_json({"series": _series(points[i:i + MAX_BATCH])})
            r = self._request("POST", f"/runs/{run_id}/metrics", content=body,
                              headers={"Content-Type": "application/json"}, retries=retries)
            result = {**r, "inserted": result["inserted"] + r["inserted"],
                      "duplicates": result["duplicates"] + r["duplicates"]}
        return result

    def add_artifact(self, run_id: int, kind: str, path: str, step: int | None = None, meta: dict | None = None):
        return self._request("POST", f"/runs/{run_id}/artifacts",
                             json={"kind": kind, "path": path, "step": step, "meta": meta or {}})

    def series(self, run_id: int, key: str, max_points: int = 2000) -> dict:
        return self._request("GET", f"/runs/{run_id}/metrics/{key}", params={"max_points": max_points})

    def stream(self, run_id: int, **kw) -> MetricStreamer:
        return MetricStreamer(self, run_id, **kw)

    def health(self) -> dict:
        return self._request("GET", "/health")

    # evaluations (lm-evaluation-harness jobs on a run's final checkpoint)
    def create_evaluation(self, run_id: int, tasks: list[str], limit: int | float | None = None) -> dict:
        body: dict = {"tasks": tasks}
        if limit is not None:
            body["limit"] = limit
        return self._request("POST", f"/runs/{run_id}/evaluations", json=body)

    def get_evaluation(self, evaluation_id: int) -> dict:
        return self._request("GET", f"/evaluations/{evaluation_id}")

    def get_evaluation_job(self, evaluation_id: int) -> dict:
        """What a worker needs to run the job: checkpoint, tasks, limit, status and the run's spec."""
        return self._request("GET", f"/evaluations/{evaluation_id}/job")

    def evaluation_heartbeat(self, evaluation_id: int, holder: str | None = None) -> dict:
        return self._request("POST", f"/evaluations/{evaluation_id}/heartbeat",
                             params={"holder": holder} if holder else None)

    def set_evaluation_status(self, evaluation_id: int, status: str, *, error_message: str | None = None,
                              lm_eval_version: str | None = None, worker_host: str | None = None) -> dict:
        body = {"status": status, "error_message": error_message, "lm_eval_version": lm_eval_version,
                "worker_host": worker_host}
        return self._request("POST", f"/evaluations/{evaluation_id}/status",
                             json={k: v for k, v in body.items() if v is not None})

    def post_evaluation_result(self, evaluation_id: int, task: str, result: dict) -> dict:
        return self._request("POST", f"/evaluations/{evaluation_id}/results", json={"task": task, "result": result})

    # GEMM benchmarks
    def create_gemm_benchmark(self, *, request: dict | None = None, result: dict | None = None,
                              experiment_id: int | None = None, name: str = "", enqueue: bool = True,
                              queue: str = "default") -> dict:
        """Queue `request` (run_gemm_benchmark kwargs) on a worker, or store a finished `result`."""
        body: dict = {"name": name, "experiment_id": experiment_id}
        if result is not None:
            body["result"] = json_safe(result)
        else:
            body.update(request=request, enqueue=enqueue, queue=queue)
        return self._request("POST", "/gemm-benchmarks", json=body)

    def post_gemm_result(self, result: dict, *, experiment_id: int | None = None, name: str = "") -> dict:
        return self.create_gemm_benchmark(result=result, experiment_id=experiment_id, name=name)

    def get_gemm_benchmark(self, benchmark_id: int) -> dict:
        return self._request("GET", f"/gemm-benchmarks/{benchmark_id}")

    def gemm_heartbeat(self, benchmark_id: int, holder: str | None = None) -> dict:
        return self._request("POST", f"/gemm-benchmarks/{benchmark_id}/heartbeat",
                             params={"holder": holder} if holder else None)

    def set_gemm_status(self, benchmark_id: int, status: str, *, result: dict | None = None,
                        device_name: str | None = None, error_message: str | None = None,
                        worker_host: str | None = None) -> dict:
        body = {"status": status, "result": json_safe(result), "device_name": device_name,
                "error_message": error_message, "worker_host": worker_host}
        return self._request("POST", f"/gemm-benchmarks/{benchmark_id}/status",
                             json={k: v for k, v in body.items() if v is not None})


def _series(points: list[dict]) -> list[dict]:
    """Row-form points grouped by key in the API's compact form (non-finite values become null)."""
    by_key: dict[str, list[list]] = {}
    for p in points:
        value, tokens, wall = p.get("value"), p.get("tokens"), p.get("wall_time")
        by_key.setdefault(p["key"], []).append([
            int(p["step"]), None if value is None else _finite_or_none(value),
            None if tokens is None else int(tokens), None if wall is None else _finite_or_none(wall)])
    return [{"key": k, "points": v} for k, v in by_key.items()]


def _finite_or_none(v: float) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


class MetricStreamer:
    """Batches metric points and sends them from a background thread, so logging never stalls a training step.

    `log()` only appends to a queue. The thread flushes every `flush_interval` seconds (or at `max_batch` points).
    A batch the API refuses (4xx: a bug of ours, a deleted run) is dropped and said so (`errors`, the job's log);
    a 409 because the run has ended (its final status was reported, e.g. the reconciler failed or cancelled it while
    this job was out of touch) sets `run_ended`, says so once and calls `on_cancel` (nothing the job does can be
    recorded any more), and later batches are dropped quietly;
    a batch that meets a 5xx or no API is retried briefly (`send_retries`, a few seconds), then written to
    `spill_path` (JSON lines) and replayed, in order, once the API answers again and at `close()` – so `flush()`
    (before every checkpoint) never waits long on the network and no point is lost (ingest is idempotent). Each
    answer carries the run's `cancel_requested` flag; when no point has been sent for `poll_interval` seconds the
    thread asks for the run itself, so cancellation reaches a quiet run too. `on_cancel` is called once.
    """

    def __init__(self, client: PlabClient, run_id: int, *, flush_interval: float = 1.0, max_batch: int = 2000,
                 poll_interval: float = 2.0, on_cancel: Callable[[], None] | None = None,
                 spill_path: str | None = None, send_retries: int = 2):
        self.client, self.run_id = client, run_id
        self.spill_path = spill_path
        self.send_retries = send_retries
        self.dropped = 0
        self.spilled = 0
        self._pending: list[list[dict]] = []  # spilled batches when there is no spill file
        self._replay_lock = threading.Lock()
        self.flush_interval, self.max_batch, self.poll_interval = flush_interval, max_batch, poll_interval
        self.on_cancel = on_cancel
        self.cancel_requested = False
        self.run_ended = False  # the API refused a batch because the run has ended (409)
        self._stop_sent = False  # on_cancel is called once, for a cancel or for the run's end
        self.sent = 0
        self.errors: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"plab-metrics-{run_id}", daemon=True)
        self._thread.start()

    def log(self, step: int, metrics: dict[str, float], *, tokens: int | None = None,
            wall_time: float | None = None) -> None:
        wall_time = time.time() if wall_time is None else wall_time
        for key, value in metrics.items():
            self._q.put({"key": key, "step": int(step), "value": _finite_or_none(value),
                         "tokens": None if tokens is None else int(tokens), "wall_time": wall_time})

    def _drain(self) -> list[dict]:
        batch = []
        while len(batch) < self.max_batch:
            try:
                batch.append(self._q.get_nowait())
            except queue.Empty:
                break
        return batch

    def _send(self, batch: list[dict]) -> None:
        try:
            if self._post(batch):
                self._replay()
            else:
                self._spill(batch)
        finally:
            for _ in batch:
                self._q.task_done()

    def _post(self, batch: list[dict]) -> bool:
        """True when the batch is settled (stored, or refused for good); False when the API was not there."""
        try:
            r = self.client.log_metrics(self.run_id, batch, retries=self.send_retries)
        except ApiError as e:
            if e.status < 500:  # our own bug, a deleted or ended run: retrying cannot help
                self.dropped += len(batch)
                if self.run_ended:
                    return True
                if e.status == 409 and self._has_ended():
                    self.run_ended = True
                    self._say(f"run {self.run_id} has ended: the API takes no more of its metric points (this batch "
                              f"of {len(batch)} and later ones are dropped); the job should stop: {e}")
                    self._stop_job()
                    return True
                self._say(f"metrics batch of {len(batch)} points of run {self.run_id} rejected, dropped: {e}")
                return True
            self.errors.append(str(e))
            return False
        except httpx.TransportError as e:
            self.errors.append(str(e))
            return False
        except Exception as e:  # noqa: BLE001 - a bug must not kill the sender thread (flush() would wait forever)
            self._say(f"metrics batch of {len(batch)} points of run {self.run_id} not sent: {type(e).__name__}: {e}")
            return False
        self.sent += len(batch)
        self._note_cancel(r.get("cancel_requested", False))
        return True

    def _say(self, message: str) -> None:
        self.errors.append(message)
        print(f"[plab] {message}", file=sys.stderr, flush=True)

    def _spill(self, batch: list[dict]) -> None:
        self.spilled += len(batch)
        if self.spill_path is None:
            with self._replay_lock:
                self._pending.append(batch)
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.spill_path)), exist_ok=True)
        with self._replay_lock, open(self.spill_path, "a") as f:
            f.write(json.dumps(batch) + "\n")

    def _replay(self) -> None:
        """Send the spilled batches in order; what still fails is kept for the next try."""
        with self._replay_lock:
            if self.spill_path is None:
                while self._pending and self._post(self._pending[0]):
                    self._pending.pop(0)
                return
            if not os.path.exists(self.spill_path):
                return
            with open(self.spill_path) as f:
                batches = [json.loads(line) for line in f if line.strip()]
            for i, batch in enumerate(batches):
                if not self._post(batch):
                    with open(self.spill_path, "w") as f:
                        f.writelines(json.dumps(b) + "\n" for b in batches[i:])
                    return
            os.remove(self.spill_path)

    def _has_ended(self) -> bool:
        """Whether the run has a final status (a 409 may have another cause); False when the API cannot say."""
        try:
            return self.client.get_run(self.run_id, retries=0).get("status") in FINAL_STATUSES
        except Exception:  # noqa: BLE001 - unknown: the batch is dropped with its message, as any 4xx
            return False

    def _stop_job(self) -> None:
        if not self._stop_sent:
            self._stop_sent = True
            if self.on_cancel:
                self.on_cancel()

    def _note_cancel(self, flag: bool) -> None:
        if flag and not self.cancel_requested:
            self.cancel_requested = True
            self._stop_job()

    def _loop(self) -> None:
        last_contact = time.monotonic()
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            while batch := self._drain():
                self._send(batch)
                last_contact = time.monotonic()
            if time.monotonic() - last_contact > self.poll_interval and not self._stop.is_set():
                try:
                    self._note_cancel(self.client.get_run(self.run_id).get("cancel_requested", False))
                except Exception as e:  # noqa: BLE001 - polling is best effort; the next poll retries
                    self.errors.append(str(e))
                last_contact = time.monotonic()

    def flush(self) -> None:
        """Block until every point logged so far has been sent, refused for good, or – the API being away –
        kept for replay (one short try; never a long wait)."""
        if self._thread.is_alive():
            self._wake.set()
            self._q.join()
        else:
            while batch := self._drain():
                self._send(batch)
        self._replay()

    def close(self) -> None:
        self.flush()
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=60)
        self.flush()
        if self.spill_path is not None and os.path.exists(self.spill_path):
            self._say(f"metric points of run {self.run_id} are kept in {self.spill_path}: the API did not take them")
        elif self._pending:
            self._say(f"{sum(map(len, self._pending))} metric points of run {self.run_id} lost: the API did not "
                      "take them and there is no spill file")

    def __enter__(self) -> MetricStreamer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def json_safe(value):
    """NaN/Inf (e.g. the relative error of a kernel that returned Inf) as null: httpx, like JSON, has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
