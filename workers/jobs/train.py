"""The training job: one run, in its own process (or torchrun's processes for a multi-GPU run).

    python -m workers.jobs.train RUN_ID

It fetches the run through the API, trains with `training.launch.run`, streams metrics through the API client from
a background thread, and reports the final status (rank 0 reports; every rank trains).
"""
from __future__ import annotations

import os
import queue
import sys
import threading

from plab.settings import get_settings
from training.sink import MetricSink
from workers.client import MetricStreamer, PlabClient
from workers.jobs import (EXIT_OK, EXIT_SKIPPED, UNREPORTED, child_command, child_main, claimed, error_message,
                          holder, lost)
from workers.jobs.lease import Heartbeat

KIND = "training"
MODULE = "workers.jobs.train"
# The run_info event's fields the run's summary gets as soon as the run starts (the model it built, its data and
# validation windows, how it is spread over devices), so the dashboard shows them during a long run, not after it.
# Progress and description updates are superseded by the next one or repeated by the result: a few retries (about
# 1.5 s), not the job client's patient ones - rank 0 waiting minutes for an API that is away would hold every other
# rank at its next collective. The conversion report and checkpoints, sent once, keep the patient retries, from
# their own thread (Reporter): the training thread hands them over and goes on.
BRIEF_RETRIES = 2
# How long a job waits, when it ends, for reports still queued (an API outage): a succeeded one before it reports its
# result (the final checkpoint is sent again with the result), a failed one after it has said it failed.
DRAIN_S = 600.0
FAILED_DRAIN_S = 60.0
RUN_INFO_FIELDS = ("params", "model", "data", "validation", "world_size", "param_dtype", "parallel",
                   "activation_checkpointing", "micro_batch", "flops_per_token")


class Reporter:
    """Sends reports that are sent once (the conversion report, each checkpoint's artifact) in order from its own
    thread, with the client's patient retries, so an API that is away holds neither rank 0's training thread nor,
    through it, the other ranks at their next collective. `close` waits for what is queued (the job's result is
    reported after its checkpoints, so an evaluation dispatched on success finds them)."""

    def __init__(self, name: str = "plab-reporter"):
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def submit(self, kind: str, send) -> None:
        if self._closed:  # the job has ended its reporting: say what is not sent
            print(f"[plab] {kind} not reported: the job's reports were already closed", file=sys.stderr, flush=True)
            return
        self._queue.put((kind, send))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, send = item
            try:
                send()
            except Exception as e:  # noqa: BLE001 - reporting must never kill a training job, nor this thread
                print(f"[plab] could not report {kind}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def close(self, timeout: float | None = None) -> bool:
        """Sends what is queued (waits at most `timeout` s; None: until done); True when every report was sent or
        given up on, False when some are still waiting for the API."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            print(f"[plab] reports still waiting for the API after {timeout:g} s; not waiting longer",
                  file=sys.stderr, flush=True)
            return False
        return True


class ApiSink(MetricSink):
    """training.sink.MetricSink that forwards to the API (non-blocking: the streamer's thread sends the metrics, the
    reporter's the conversion report and checkpoints; progress and description are sent with brief retries)."""

    def __init__(self, client: PlabClient, run_id: int, streamer: MetricStreamer | None):
        self.client, self.run_id, self.streamer = client, run_id, streamer
        self.reporter = Reporter(f"plab-reporter-{run_id}") if streamer is not None else None

    def log(self, step: int, metrics: dict, *, tokens: int, wall_time: float) -> None:
        if self.streamer is not None:
            self.streamer.log(step, metrics, tokens=tokens, wall_time=wall_time)

    def event(self, kind: str, **fields) -> None:
        if self.streamer is None:
            return
        try:
            if kind == "conversion_report":
                report = fields.get("report") or {}
                self.reporter.submit(kind, lambda: self.client.update_run(
                    self.run_id, conversion_report=report, gemm_backend=report.get("gemm_backend")))
            elif kind == "data_progress":  # tokenizing before the first step: the run row shows it
                self.client.update_run(self.run_id, summary={"data_progress": fields}, retries=BRIEF_RETRIES)
            elif kind == "run_info":  # what the run is, while it trains (the result's summary repeats it)
                self.client.update_run(self.run_id, summary={k: fields[k] for k in RUN_INFO_FIELDS if k in fields},
                                       retries=BRIEF_RETRIES)
            elif kind == "resumed":  # the run page and the API say where this attempt started
                self.client.update_run(self.run_id, summary={"resumed_from_step": fields.get("step")},
                                       retries=BRIEF_RETRIES)
            elif kind == "checkpoint":
                path, step = _portable(fields.get("path")), fields.get("step")
                meta = {k: v for k, v in fields.items() if k not in ("path", "step")}
                self.reporter.submit(kind, lambda: self.client.add_artifact(self.run_id, "checkpoint", path,
                                                                            step=step, meta=meta))
        except Exception as e:  # noqa: BLE001 - reporting must never kill a training job (a NaN in JSON: ValueError)
            print(f"[plab] could not report {kind}: {e}", file=sys.stderr)

    def flush(self) -> None:
        if self.streamer is not None:
            self.streamer.flush()

    def close(self, timeout: float | None = None) -> bool:
        """Waits for the reports still queued (at most `timeout` s); True when every one was sent or given up."""
        return self.reporter.close(timeout) if self.reporter is not None else True


def device_name() -> str:
    import torch

    from training.devices import cpu_name

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return cpu_name()  # the name the run's result and a GEMM benchmark on this machine record


def command(run_id: int, gpus: int | None = None, nodes: int | None = None) -> list[str]:
    """One process, or torchrun with one process per GPU. A message queued before the API sent `gpus` has none:
    the run's spec says."""
    if gpus is None:
        with PlabClient.from_env() as client:
            from plab.broker import train_gpus  # Celery only where a job runs, not for the bench's ApiSink

            gpus = train_gpus(client.get_run(run_id).get("spec") or {})
    if gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                "-m", MODULE, str(run_id)]
    return child_command(MODULE, run_id)


def record(client: PlabClient, run_id: int) -> dict:
    return client.get_run(run_id)


def status(client: PlabClient, run_id: int) -> str:
    return record(client, run_id)["status"]


def mark_failed(client: PlabClient, run_id: int, message: str) -> None:
    client.set_status(run_id, "failed", error_message=message)


def run(run_id: int) -> int:
    rank = int(os.environ.get("RANK", "0"))
    # A job that starts while the API is away waits for it (about 10 minutes of retries) instead of failing.
    client = PlabClient.from_env(retries=60)
    record = client.get_run(run_id)
    if record["status"] not in UNREPORTED or record["cancel_requested"]:
        print(f"[plab] run {run_id} is '{record['status']}'; nothing to do")
        return EXIT_SKIPPED

    from training.config import RunSpec
    from training import launch

    stop = threading.Event()
    output_dir = get_settings().home / "runs" / str(run_id)
    # Points the API cannot take for a while wait in the run's folder and are replayed (MetricStreamer).
    streamer = (client.stream(run_id, on_cancel=stop.set, spill_path=str(output_dir / "metrics-spill.jsonl"))
                if rank == 0 else None)
    beat = None
    if rank == 0:
        if not claimed(lambda: client.set_status(run_id, "running", worker_host=holder(), device_name=device_name()),
                       "run", run_id):
            if streamer is not None:
                streamer.close()
            return EXIT_SKIPPED
        beat = Heartbeat(client, run_id, get_settings().heartbeat_s, on_lost=stop.set, on_cancel=stop.set,
                         holder=holder())
    sink = ApiSink(client, run_id, streamer)
    try:
        spec = RunSpec.from_dict(record["spec"])
        result = launch.run(spec, sink, should_stop=stop.is_set, output_dir=output_dir, resume=True)
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then re-raised as an exit code
        if beat is not None:
            beat.stop()
        if streamer is not None:
            streamer.close()
        if rank == 0:
            client.set_status(run_id, "failed", error_message=error_message(e))
        sink.close(FAILED_DRAIN_S)  # after the failure is known: a supervisor's kill meanwhile loses no message
        raise
    sink.close(DRAIN_S)  # the conversion report and checkpoints before the result: an evaluation may start on success
    if beat is not None:
        beat.stop()
    if streamer is not None:
        streamer.close()
    if beat is not None and beat.lost:  # its lease lapsed and the run was given to another job
        return lost("run", run_id)
    if streamer is not None and streamer.run_ended:
        print(f"[plab] run {run_id} ended while this job trained it (the API refused its metrics); this job stops "
              "unreported", flush=True)
        return EXIT_SKIPPED
    if rank == 0:
        _report(client, run_id, result)
    return EXIT_OK


def _portable(path) -> str:
    """Checkpoints under PLAB_HOME are recorded relative to it, so the folder can move."""
    from plab.settings import portable_path

    return portable_path(path, get_settings().home)


def _report(client: PlabClient, run_id: int, result) -> None:
    summary = dict(result.summary or {})
    summary.update({"final_loss": result.final_loss, "final_val_loss": result.final_val_loss,
                    "steps": result.steps, "tokens": result.tokens})
    if result.checkpoint_dir:  # before the final status: a succeeded run may be evaluated at once
        client.add_artifact(run_id, "checkpoint", _portable(result.checkpoint_dir), step=result.steps,
                            meta={"format": "hf", "final": True})
    client.set_status(run_id, result.status, diverged_step=result.diverged_step, summary=summary,
                      gemm_backend=result.gemm_backend, device_name=result.device_name)


if __name__ == "__main__":
    sys.exit(child_main(run, MODULE))
