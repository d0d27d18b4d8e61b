"""Train several run specs one after the other in the same torchrun process group (one launch, many runs:
starting processes is most of the cost of a tiny CPU run). Used by the FSDP tests.

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


def main(path: str) -> int:
    jobs = json.loads(Path(path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    dist.init_process_group("gloo")
    try:
        for job in jobs:
            sink = JsonlSink(job["metrics"]) if rank == 0 else NullSink()
            result = launch.run(job["spec"], sink, output_dir=job["output_dir"], cache_dir=job.get("cache_dir"))
            sink.close()
            if rank == 0:
                Path(job["result"]).write_text(json.dumps(result.to_dict()))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
