"""Per-step metrics from the device to the sink without a host synchronisation inside a GPU step.

The loss and grad norm of step s are copied to pinned host memory with `non_blocking=True` behind a CUDA
event and read `lag` steps later (or as soon as the event has fired); the step time is measured between
those events, so it is the GPU's time per step, not the host's. A NaN/Inf loss is therefore noticed a few
steps late on GPU, but the reported diverged step is the step whose loss was non-finite. On CPU every step
is read at once and timed on the host clock.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch

from training.checkpoint import TrainState
from training.flops import mfu
from training.sink import MetricSink


@dataclass
class StepRecord:
    """What the host knows of a step when it has issued it (its scalars are still on the device)."""
    lr: float
    tokens: int              # global tokens consumed after this step
    wall: float              # the run's wall time when the step was issued
    data_wait: float         # seconds the loader kept the step waiting for its batch
    host_end: float          # time.perf_counter() when the step was issued (the step clock on CPU)
    host_issue: float        # host seconds to issue the step, the loader's wait excluded


class MetricsDrain:
    """Owns the pending device scalars of issued steps, the step clock and divergence detection; logs
    each step's `train/*` and `perf/*` metrics to the sink, keeps `state.loss` at the last finite loss
    logged (what a checkpoint stores) and the step times for `summary()`."""

    def __init__(self, sink: MetricSink, state: TrainState, *, device: torch.device, device_name: str,
                 lag: int, tokens_per_step: int, flops_per_token: float, world: int = 1):
        self.sink, self.state = sink, state
        self.device, self.device_name, self.world = device, device_name, world
        self.cuda = device.type == "cuda"
        self.lag = lag
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.pending: deque = deque()    # (step, values, end event | None, StepRecord), oldest first
        self.diverged_step: int | None = None
        self.step_times: list[float] = []
        self.data_waits: list[float] = []
        self._prev_event = None          # the end of the previous timed step (CUDA)
        self._prev_host = 0.0            # ... (CPU)

    @property
    def diverged(self) -> bool:
        return self.diverged_step is not None

    def start_clock(self, now: float) -> None:
        """At the start of the loop: the first step is timed from here; peak memory counts from here."""
        self._prev_host = now
        if self.cuda:
            self._prev_event = torch.cuda.Event(enable_timing=True)
            self._prev_event.record()
            torch.cuda.reset_peak_memory_stats(self.device)

    def restart_clock(self) -> None:
        """After validation or a checkpoint, so that their time is not booked to the next step."""
        if self.cuda:
            self._prev_event = torch.cuda.Event(enable_timing=True)
            self._prev_event.record()
        else:
            self._prev_host = time.perf_counter()

    def push(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, record: StepRecord) -> None:
        """Queue step `step`'s loss and grad norm (device scalars) without waiting for them."""
        values = torch.stack([loss.float(), grad_norm.float().reshape(())])
        if self.cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pending.append((step, host, event, record))
        else:
            self.pending.append((step, values, None, record))

    def poll(self) -> None:
        """Log every step whose scalars are on the host (all of them on CPU)."""
        self._drain(flush=False)

    def flush(self) -> None:
        """Wait for every pending step and log it."""
        self._drain(flush=True)

    def _drain(self, flush: bool) -> None:
        """Log ready steps in order; after the first non-finite loss, later steps are dropped unlogged."""
        for step, (loss, grad_norm), end_event, record in self._ready(flush):
            if self.diverged:
                continue
            step_s = self._step_seconds(end_event, record)
            if not math.isfinite(loss):
                self.diverged_step = step
                self.sink.log(step, {"train/loss": loss}, tokens=record.tokens, wall_time=record.wall)
                continue
            self.state.loss = loss
            self._log(step, loss, grad_norm, step_s, record)

    def _ready(self, flush: bool):
        """(step, host values, end event, record) of the steps that are done or older than `lag`."""
        while self.pending:
            step, values, event, record = self.pending[0]
            if not (flush or not self.cuda or len(self.pending) > self.lag or event.query()):
                return
            self.pending.popleft()
            if event is not None:
                event.synchronize()
            yield step, values.tolist(), event, record

    def _step_seconds(self, end_event, record: StepRecord) -> float:
        if end_event is not None:
            step_s = self._prev_event.elapsed_time(end_event) / 1000.0
            self._prev_event = end_event
        else:
            step_s = record.host_end - self._prev_host
            self._prev_host = record.host_end
        return step_s

    def _log(self, step: int, loss: float, grad_norm: float, step_s: float, record: StepRecord) -> None:
        tok_s = self.tokens_per_step / step_s if step_s > 0 else float("nan")
        metrics = {"train/loss": loss, "train/lr": record.lr, "train/grad_norm": grad_norm,
                   "perf/tokens_per_s": tok_s, "perf/step_time_s": step_s,
                   "perf/data_wait_s": record.data_wait, "perf/tflops": self.flops_per_token * tok_s / 1e12,
                   # near step_time_s: the step is bound by the host issuing kernels, not by the GPU
                   "perf/host_issue_s": record.host_issue}
        m = mfu(self.flops_per_token, tok_s, device_name=self.device_name, n_gpus=self.world)
        if m is not None:
            metrics["perf/mfu"] = m
        if self.cuda:
            metrics["perf/peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.step_times.append(step_s)
        self.data_waits.append(record.data_wait)
        self.sink.log(step, metrics, tokens=record.tokens, wall_time=record.wall)

    def summary(self) -> dict:
        """Steady-state figures: medians over steps, skipping the first two (compile, allocator warm-up) when the
        run has more than four (a shorter run's median includes them: time runs of a few steps with
        bench/train_bench.py, which gates its warm-up). `tokens_per_s` and `tflops` are totals over the run's
        `world` processes (GPUs), as `perf/tokens_per_s` and `perf/tflops` are; `..._per_gpu` divides them."""
        times = self.step_times[2:] if len(self.step_times) > 4 else self.step_times
        if not times:
            return {}
        step_s = statistics.median(times)
        tok_s = self.tokens_per_step / step_s
        out = {"tokens_per_s": tok_s, "step_time_s": step_s, "tflops": self.flops_per_token * tok_s / 1e12,
               "tokens_per_s_per_gpu": tok_s / self.world,
               "tflops_per_gpu": self.flops_per_token * tok_s / 1e12 / self.world,
               "data_wait_share": sum(self.data_waits[-len(times):]) / sum(times),
               "mfu": mfu(self.flops_per_token, tok_s, device_name=self.device_name, n_gpus=self.world)}
        if self.cuda:
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out
