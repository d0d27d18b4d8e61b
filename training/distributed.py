"""Multi-process data parallelism: the process group torchrun sets up, seen as a `DistContext`.

Why DDP and not FSDP2: for models up to ~1B parameters the FP32 master weights, gradients and AdamW
state (16 bytes/param ≈ 18 GiB for the 1b preset) fit on every GPU, so sharding them buys nothing but
costs an all-gather of the weights before every forward and a reduce-scatter instead of an all-reduce
after the backward. DDP overlaps one bucketed all-reduce with the backward and keeps each rank's model
an ordinary module, which the precision recipes (module swaps, per-layer hooks) convert as on one GPU.
Revisit for models whose training state does not fit one device.

Processes are launched by `python -m training` under torchrun (`training.launch`); every rank trains,
rank 0 alone reports to the sink. On CPU the gloo backend is used (tests).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    stop_group: object = None  # a gloo group for host-side flags (no GPU sync)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.enabled:
            dist.barrier(group=self.stop_group)

    def any_true(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank; CPU-only collective, so it never waits on
        the GPU stream."""
        if not self.enabled:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.stop_group)
        return bool(t.item())


# The context of the process group this process has joined, keyed by that group: the launcher joins before
# `train` does, and creating the gloo side group is itself a collective that must not run twice.
_joined: tuple[object, DistContext] | None = None


def init_distributed(device_kind: str) -> DistContext:
    """Join the torchrun process group when WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU); a second call
    returns the same context while that group lives."""
    global _joined
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device_kind == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
    if _joined is not None and _joined[0] is dist.group.WORLD:
        return _joined[1]
    stop_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    ctx = DistContext(rank=rank, world=world, local_rank=local_rank, stop_group=stop_group)
    _joined = (dist.group.WORLD, ctx)
    return ctx


def init_single_process_group(device_kind: str) -> None:
    """A process group of this process alone (FSDP2 needs one even on one GPU); nothing if a group exists."""
    if dist.is_initialized():
        return
    backend = "nccl" if device_kind == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
