"""Multi-process data parallelism (torchrun) and its launcher entry point.

Why DDP and not FSDP2: for models up to ~1B parameters the FP32 master weights, gradients and AdamW
state (16 bytes/param ≈ 18 GiB for the 1b preset) fit on every GPU, so sharding them buys nothing but
costs an all-gather of the weights before every forward and a reduce-scatter instead of an all-reduce
after the backward. DDP overlaps one bucketed all-reduce with the backward and keeps each rank's model
an ordinary module, which the precision recipes (module swaps, per-layer hooks) convert as on one GPU.
Revisit for models whose training state does not fit one device.

Launch (what workers run for `training.gpus = N`):

    torchrun --standalone --nproc-per-node N -m training.distributed SPEC.json \
        --output-dir DIR [--metrics-jsonl FILE] [--result-json FILE]

Rank 0 reports to the sink; every rank trains. On CPU the gloo backend is used (tests).
"""
from __future__ import annotations

import argparse
import json
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


def init_distributed(device_kind: str) -> DistContext:
    """Join the torchrun process group when WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU)."""
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
    stop_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return DistContext(rank=rank, world=world, local_rank=local_rank, stop_group=stop_group)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Train one run spec (under torchrun for several GPUs/processes).")
    ap.add_argument("spec", help="path of a run-spec JSON file")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--metrics-jsonl", default=None, help="rank 0 appends metrics/events here")
    ap.add_argument("--result-json", default=None, help="rank 0 writes the TrainResult here")
    ap.add_argument("--no-resume", action="store_true")
    a = ap.parse_args(argv)

    from training.config import RunSpec
    from training.sink import JsonlSink, NullSink
    from training.train import train

    with open(a.spec) as f:
        spec = RunSpec.from_dict(json.load(f))
    rank = int(os.environ.get("RANK", "0"))
    sink = JsonlSink(a.metrics_jsonl) if (a.metrics_jsonl and rank == 0) else NullSink()
    try:
        result = train(spec, sink, output_dir=a.output_dir, resume=not a.no_resume)
    finally:
        sink.close()
    if rank == 0 and a.result_json:
        with open(a.result_json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
