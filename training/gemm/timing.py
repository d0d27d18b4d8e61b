"""Timing one prepared call (a GEMM, or the quantization of one tensor): the protocol of
`triton.testing.do_bench`, plus operands rotated over several sets.

Protocol on CUDA, per timed call (as do_bench, triton 3.x):

    flush.zero_()          # a 256 MiB buffer written between calls, so no call finds its operands in L2
    start[i].record(); run(i mod n_buffers); end[i].record()

All calls are enqueued and read after one synchronisation; the figure is the median of the per-call
event intervals (the flush itself is outside every interval). Warm-up calls run without the flush, as in
do_bench. Counts: given explicitly (`warmup`, `repeats`), or - when left None - chosen as do_bench
chooses them: one call, five calls with flushes to estimate the per-call time t (flush included), then
max(1, 25 ms / t) warm-up calls and max(1, 100 ms / t) timed calls. The rotation over `n_buffers` operand
sets (rotating the inputs so the timing is not of L2) is kept on top of the flush; either alone
keeps L2 from serving the operands.

Earlier versions enqueued the calls back to back with no flush in between; in one H200 run that read
-7% (BF16) and +15% (FP8) against do_bench, taken before and after it, with the clock drifting and the
FP8 operands scaled differently as well. The tool now follows do_bench, and the acceptance run
(bench/gemm_bench.py part a) interleaves the two and separates protocol from operand data.

On CPU `time.perf_counter` brackets each call, with no flush, and results are labelled "CPU".
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

# H100 SXM has 50 MB of L2; the rotating operand sets together must exceed it several times over so
# that each call reads its operands from HBM, as in a training step.
L2_BYTES = 50 * 2**20
ROTATION_FACTOR = 4
MAX_BUFFERS = 32
# do_bench (triton.runtime.driver ... get_empty_cache_for_benchmark): 256 MiB of int32, zeroed per call.
FLUSH_BYTES = 256 * 2**20
# do_bench defaults: warm-up and timed budgets in milliseconds.
WARMUP_MS = 25.0
REP_MS = 100.0
ESTIMATE_CALLS = 5
CPU_DEFAULT_WARMUP, CPU_DEFAULT_REPEATS = 1, 3

PROTOCOL = ("do_bench-like: per-call CUDA events, 256 MiB L2 flush (zero_) before each timed call, "
            "operands rotated over several sets, median")

_flush_buffers: dict = {}


def buffer_count(bytes_per_set: int, device: torch.device, *, memory_fraction: float = 0.25) -> int:
    """How many operand sets to rotate among: enough to exceed ROTATION_FACTOR × L2, at least 2."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be positive, got {bytes_per_set}")
    if device.type != "cuda":
        return 2  # CPU caches are small next to any shape worth timing; two sets keep the code path
    wanted = max(2, math.ceil(ROTATION_FACTOR * L2_BYTES / bytes_per_set))
    free, _ = torch.cuda.mem_get_info(device)
    affordable = max(1, int(memory_fraction * free // bytes_per_set))
    return max(1, min(wanted, affordable, MAX_BUFFERS))


def flush_buffer(device: torch.device) -> torch.Tensor:
    """The L2-flush buffer of `device` (allocated once)."""
    key = str(device)
    if key not in _flush_buffers:
        _flush_buffers[key] = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return _flush_buffers[key]


def _check_count(name: str, value, low: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise ValueError(f"{name} must be None (do_bench's time-based count) or an integer >= {low}, got {value!r}")


def time_gemm(run: Callable[[int], object], n_buffers: int, device: torch.device, *,
              warmup: int | None = 3, repeats: int | None = 10, flush_l2: bool = True) -> dict:
    """Median seconds per call of `run(i)`, i cycling over the `n_buffers` operand sets.

    `warmup` / `repeats` None: do_bench's time-based counts (CUDA), 1 / 3 on CPU.
    """
    if n_buffers < 1:
        raise ValueError(f"n_buffers must be >= 1, got {n_buffers}")
    _check_count("warmup", warmup, 0)
    _check_count("repeats", repeats, 1)
    if device.type != "cuda":
        warmup = CPU_DEFAULT_WARMUP if warmup is None else warmup
        repeats = CPU_DEFAULT_REPEATS if repeats is None else repeats
        for i in range(warmup):
            run(i % n_buffers)
        samples = []
        for r in range(repeats):
            t0 = time.perf_counter()
            run(r % n_buffers)
            samples.append(time.perf_counter() - t0)
        return _summary(samples, warmup, repeats, n_buffers, "CPU", "wall clock per call (CPU)", None)

    flush = flush_buffer(device) if flush_l2 else None

    def clear():
        if flush is not None:
            flush.zero_()

    estimate_ms = None
    calls = 0
    if warmup is None or repeats is None:
        run(0)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(ESTIMATE_CALLS):
            clear()
            run((i + 1) % n_buffers)
        end.record()
        torch.cuda.synchronize(device)
        estimate_ms = max(start.elapsed_time(end) / ESTIMATE_CALLS, 1e-6)
        calls = ESTIMATE_CALLS + 1
        warmup = max(1, int(WARMUP_MS / estimate_ms)) if warmup is None else warmup
        repeats = max(1, int(REP_MS / estimate_ms)) if repeats is None else repeats
    for i in range(warmup):
        run((calls + i) % n_buffers)
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for r in range(repeats):
        clear()
        starts[r].record()
        run(r % n_buffers)
        ends[r].record()
    torch.cuda.synchronize(device)
    samples = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    protocol = PROTOCOL if flush_l2 else "per-call CUDA events, no L2 flush, operands rotated, median"
    return _summary(samples, warmup, repeats, n_buffers, "cuda_events", protocol, estimate_ms)


def _summary(samples, warmup, repeats, n_buffers, timer, protocol, estimate_ms) -> dict:
    out = {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
           "repeats": repeats, "warmup": warmup, "buffers": n_buffers, "timer": timer, "protocol": protocol}
    if estimate_ms is not None:
        out["estimate_ms"] = estimate_ms
    return out
