"""The name a run or a benchmark records for the device it ran on, the same everywhere.

A GPU is torch's device name ("NVIDIA H200"); a CPU is its model name from /proc/cpuinfo ("AMD EPYC 7B13 64-Core
Processor"), else the platform's processor or machine string. The dashboard puts a GEMM benchmark's prediction
next to a run's measured speedup only when both name the same device, as for GPUs: a training run's CPU was once
recorded as "cpu" (and "cpu (N cores)" by the worker) and the benchmark's as "x86_64", so that never held on a CPU.
"""
from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model") and value.strip():
                    return value.strip()[:200]
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def device_label(device) -> str:
    """`device` a torch.device (or "cpu"/"cuda[:N]")."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()
