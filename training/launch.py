"""The one entry point for training a run spec: the command line, the worker's job and torchrun use it.

    python -m training SPEC.json --output-dir DIR [--no-resume] [--metrics-jsonl FILE] [--result-json FILE]
    torchrun --standalone --nproc-per-node N -m training SPEC.json --output-dir DIR ...   (training.gpus = N)

`run(spec, sink, ...)` is what the command runs, for callers with their own sink (the worker streams to the
API): it joins the process group torchrun set up (NCCL on CUDA, gloo on CPU), trains, and leaves the group.
Every rank trains; rank 0 alone reports to the sink and writes the result.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from training.config import RunSpec, SpecError
from training.corpus import CorpusError
from training.outputs import outputs_problem
from training.precision.catalog import RecipeError
from training.distributed import init_distributed
from training.setup import device_kind
from training.sink import JsonlSink, MetricSink, NullSink
from training.train import TrainResult, train


# What a run can find wrong with its spec only once it opens the corpus, tokenizer or model.
INPUT_ERRORS = (SpecError, CorpusError, RecipeError)


def run(spec: RunSpec | dict, sink: MetricSink | None = None, *, output_dir, resume: bool = True,
        should_stop=None, cache_dir=None) -> TrainResult:
    """Train `spec` in this process, one rank of `training.gpus` under torchrun or alone; see
    `training.train.train` for the arguments and the result. A process group this call creates is destroyed
    when it returns (or raises); one the caller created is left to the caller."""
    if isinstance(spec, dict):
        spec = RunSpec.from_dict(spec)
    owns_group = not dist.is_initialized()
    init_distributed(device_kind(spec))
    try:
        return train(spec, sink, should_stop=should_stop, output_dir=output_dir, resume=resume, cache_dir=cache_dir)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training",
                                 description="Train one run spec (under torchrun for several GPUs/processes).")
    ap.add_argument("spec", help="path of a run-spec JSON file (docs/INTERFACES.md)")
    ap.add_argument("--output-dir", required=True, help="checkpoints go to DIR/checkpoints; a run resumes from there")
    ap.add_argument("--metrics-jsonl", default=None, help="rank 0 appends metrics/events here")
    ap.add_argument("--result-json", default=None, help="rank 0 writes the TrainResult here")
    ap.add_argument("--no-resume", action="store_true",
                    help="start from step 0 even if DIR holds checkpoints (they are moved to "
                         "DIR/checkpoints.before-<time>)")
    a = ap.parse_args(argv)
    spec = _read_spec(ap, a.spec)
    problem = outputs_problem((("--output-dir", a.output_dir, True), ("--metrics-jsonl", a.metrics_jsonl, False),
                               ("--result-json", a.result_json, False)))
    if problem:
        ap.error(problem)

    rank = int(os.environ.get("RANK", "0"))
    sink = JsonlSink(a.metrics_jsonl) if (a.metrics_jsonl and rank == 0) else NullSink()
    try:
        result = run(spec, sink, output_dir=a.output_dir, resume=not a.no_resume)
    except INPUT_ERRORS as e:  # found once the data or model is opened: the user's to fix, not a traceback
        print(f"{ap.prog}: error: {a.spec}: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        sink.close()
    if rank == 0 and a.result_json:
        Path(a.result_json).write_text(json.dumps(result.to_dict(), indent=1))
    return 0


def _read_spec(ap: argparse.ArgumentParser, path: str) -> RunSpec:
    """The run spec in `path`; a usage error (exit status 2) that says what is wrong otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        ap.error(f"cannot read the run spec {path}: {e.strerror or e}")
    except json.JSONDecodeError as e:
        ap.error(f"the run spec {path} is not valid JSON: {e}")
    if not isinstance(data, dict):
        ap.error(f"the run spec {path} must hold a JSON object (docs/INTERFACES.md), not a {type(data).__name__}")
    try:
        return RunSpec.from_dict(data)
    except SpecError as e:
        ap.error(f"{path}: {e}")
