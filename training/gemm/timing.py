"""Timing one prepared GEMM: warm-up, median of repeats, operands rotated so L2 does not serve them.

On CUDA each call is bracketed by its own pair of CUDA events, all calls enqueued back to back and read
after one synchronisation (as triton.testing.do_bench does), so host launch latency hides behind the
previous call. On CPU `time.perf_counter` brackets each call and results are labelled "CPU".
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


def time_gemm(run: Callable[[int], torch.Tensor], n_buffers: int, device: torch.device, *,
              warmup: int = 3, repeats: int = 10) -> dict:
    """Median seconds per call of `run(i)` over `repeats` calls, i cycling over the buffers."""
    if n_buffers < 1:
        raise ValueError(f"n_buffers must be >= 1, got {n_buffers}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    for i in range(warmup):
        run(i % n_buffers)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for r in range(repeats):
            starts[r].record()
            run(r % n_buffers)
            ends[r].record()
        torch.cuda.synchronize(device)
        samples = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
        timer = "cuda_events"
    else:
        samples = []
        for r in range(repeats):
            t0 = time.perf_counter()
            run(r % n_buffers)
            samples.append(time.perf_counter() - t0)
        timer = "CPU"
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
            "repeats": repeats, "warmup": warmup, "buffers": n_buffers, "timer": timer}
