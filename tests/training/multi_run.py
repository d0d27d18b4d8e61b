"""Train several run specs one after the other in the same torchrun process group (one launch, many runs:
starting processes is most of the cost of a tiny CPU run). Used by the FSDP tests: gloo processes where the jobs
run on the CPU, NCCL with one GPU per process (LOCAL_RANK) where they run on CUDA.

    torchrun --standalone --nproc-per-node N tests/training/multi_run.py JOBS.json

JOBS.json: [{"spec": {...}, "output_dir": DIR, "metrics": FILE, "result": FILE, "cache_dir": DIR}, ...]
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from training import launch  # noqa: E402
from training.sink import JsonlSink, NullSink  # noqa: E402


def record_delayed_scales() -> list:
    """Every fp8_delayed scale this rank uses, step by step: the scales (per layer, X/W/dY) right after each
    optimizer step's history update, which the next step casts with."""
    import torch

    from training.precision.fp8_delayed import DelayedScalingHook

    seen = []
    update = DelayedScalingHook.post_optimizer_step

    def recording(self, model=None):
        update(self, model)
        seen.append(torch.stack([m.scales for _, m in self.layers]).clone())

    DelayedScalingHook.post_optimizer_step = recording
    return seen


def main(path: str) -> int:
    import torch

    jobs = json.loads(Path(path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    scales = record_delayed_scales()
    device = {job["spec"].get("training", {}).get("device", "cpu") for job in jobs}
    if len(device) != 1:
        raise SystemExit(f"multi_run: the jobs must share one device kind, got {sorted(device)}")
    if device == {"cuda"}:
        from training.distributed import init_distributed
        init_distributed("cuda")  # NCCL, this rank's GPU; train() joins the same group
    else:
        dist.init_process_group("gloo")
    try:
        for job in jobs:
            sink = JsonlSink(job["metrics"]) if rank == 0 else NullSink()
            scales.clear()
            result = launch.run(job["spec"], sink, output_dir=job["output_dir"], cache_dir=job.get("cache_dir"))
            sink.close()
            if scales:
                torch.save(torch.stack(scales), f"{job['metrics']}.scales_rank{rank}.pt")
            if rank == 0:
                Path(job["result"]).write_text(json.dumps(result.to_dict()))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
