"""`plab submit FILE` (an experiment through the API), `plab retry RUN_ID` (a failed or cancelled run queued again)
and `plab train FILE` (one run here, no server)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from plab.cli.common import UsageError, api_call, load_file, whole_number
from training.outputs import outputs_problem
from training.sink import MetricSink, NullSink


def cmd_submit(args) -> int:
    from workers.client import PlabClient

    body = load_file(args.file)
    client = PlabClient.from_env(args.api_url, retries=2)  # a server that is down: said in ~2 s
    with api_call(client.base_url, "the experiment"):
        exp = client.create_experiment(body)
    print(f"experiment {exp['id']} '{exp['name']}': {len(exp['runs'])} run(s) queued "
          f"({', '.join(r['label'] for r in exp['runs'])})")
    print(f"{client.base_url}/experiments/{exp['id']}")
    return 0


def cmd_retry(args) -> int:
    from workers.client import PlabClient

    client = PlabClient.from_env(args.api_url, retries=2)
    with api_call(client.base_url, f"the retry of run {args.run_id}"):
        run = client.retry_run(args.run_id)
    print(f"run {run['id']} ({run['label']}) queued again: its job resumes from the run's last checkpoint "
          f"(from step 0 if it wrote none); its metrics so far are kept")
    print(f"{client.base_url}/runs/{run['id']}")
    return 0


class ProgressPrinter(MetricSink):
    """Prints the loss every `every` steps and passes everything on to `inner` (a JSONL file, or nothing)."""

    def __init__(self, inner: MetricSink | None, every: int):
        self.inner, self.every = inner, every

    def log(self, step, metrics, *, tokens, wall_time):
        if self.inner:
            self.inner.log(step, metrics, tokens=tokens, wall_time=wall_time)
        if "train/loss" in metrics and (step % self.every == 0):
            print(f"step {step:>6}  loss {metrics['train/loss']:.4f}  "
                  f"tok/s {metrics.get('perf/tokens_per_s', float('nan')):,.0f}", flush=True)

    def event(self, kind, **fields):
        if self.inner:
            self.inner.event(kind, **fields)
        if kind == "resumed":
            print(f"resumed from {fields.get('path')} (step {fields.get('step')})", flush=True)
        elif kind == "checkpoints_set_aside":
            print(f"--no-resume: the earlier checkpoints in this output folder were moved to {fields.get('path')}",
                  flush=True)

    def close(self):
        if self.inner:
            self.inner.close()


def cmd_train(args) -> int:
    from training.checkpoint import latest_checkpoint
    from training.config import RunSpec, SpecError, check_new_run_data
    from training.sink import JsonlSink
    from training import launch

    data = load_file(args.file)
    if args.recipe:
        data["recipe"] = args.recipe
    try:
        spec = RunSpec.from_dict(data)
        if args.no_resume or latest_checkpoint(Path(args.output)) is None:  # a new run, not one resumed
            check_new_run_data(spec.data)
    except SpecError as e:
        raise UsageError(f"{args.file}: {e}") from e
    problem = outputs_problem((("--output", args.output, True), ("--metrics", args.metrics, False),
                               ("--result-json", args.result_json, False)))
    if problem:
        raise UsageError(problem)
    if spec.training.gpus > 1 and "WORLD_SIZE" not in os.environ:
        return _torchrun(args, spec)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    sink = (ProgressPrinter(JsonlSink(args.metrics) if args.metrics else None, args.print_every) if rank0
            else NullSink())
    try:
        result = launch.run(spec, sink, output_dir=Path(args.output), resume=not args.no_resume)
    except launch.INPUT_ERRORS as e:
        raise UsageError(f"{args.file}: {e}") from e
    except KeyboardInterrupt:
        if rank0:
            print(f"plab: {_interrupted(spec, Path(args.output))}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None  # the shell's status for SIGINT, without a traceback
    finally:
        sink.close()
    if not rank0:
        return 0
    summary = {"status": result.status, "steps": result.steps, "final_loss": result.final_loss,
               "final_val_loss": result.final_val_loss, "diverged_step": result.diverged_step,
               "gemm_backend": result.gemm_backend, "parallel": result.summary.get("parallel"),
               "world_size": result.summary.get("world_size"), "checkpoint": str(result.checkpoint_dir)}
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(summary))
    print(json.dumps(summary, indent=2))
    return 0 if result.status == "succeeded" else 1


def _interrupted(spec, output: Path) -> str:
    """What Ctrl-C during training left: the checkpoint the same command resumes from, or none (every step
    since the start is lost: say so, and how to keep them next time)."""
    from training.checkpoint import latest_checkpoint

    last = latest_checkpoint(output)
    if last is not None:
        return f"interrupted (the same command resumes the run from its last checkpoint, {output / last.name})"
    every = spec.training.checkpoint_every
    return (f"interrupted before the run wrote a checkpoint (training.checkpoint_every: "
            f"{every or '0, one at the end only'}): the same command starts it again from its first step; set "
            f"training.checkpoint_every to keep the steps a run has trained")


def _torchrun(args, spec) -> int:
    """`training.gpus` > 1: this command again in one process per GPU under torchrun (gloo processes on a
    machine without GPUs), with the spec as given (and --recipe applied); its exit status."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="plab-train-") as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec.to_dict()))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={spec.training.gpus}", "-m", "plab.cli", "train", str(spec_file),
               "--output", str(args.output), "--print-every", str(args.print_every)]
        cmd += ["--metrics", str(Path(args.metrics).resolve())] if args.metrics else []
        cmd += ["--no-resume"] if args.no_resume else []
        cmd += ["--result-json", args.result_json] if args.result_json else []
        print(f"[plab] training.gpus={spec.training.gpus}: starting {spec.training.gpus} processes (torchrun)",
              flush=True)
        return subprocess.run(cmd).returncode


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sm = sub.add_parser("submit", help="create an experiment from a YAML/JSON file")
    sm.add_argument("file")
    sm.add_argument("--api-url", help="default: $PLAB_API_URL or http://127.0.0.1:8000")
    sm.set_defaults(func=cmd_submit)

    rt = sub.add_parser("retry", help="queue a failed or cancelled run again (it resumes from its checkpoint)",
                        description="Send a failed or cancelled run to a worker again through the API: it resumes "
                                    "from the last checkpoint it wrote (training.checkpoint_every), keeping its "
                                    "metrics so far. A diverged run is refused (the same spec diverges again).")
    rt.add_argument("run_id", type=whole_number(1), help="the run's id (shown on its page and by the API)")
    rt.add_argument("--api-url", help="default: $PLAB_API_URL or http://127.0.0.1:8000")
    rt.set_defaults(func=cmd_retry)

    t = sub.add_parser("train", help="train one run from a run-spec file, no server",
                       description="Train one run from a run-spec file (YAML or JSON) in this process (torchrun's "
                                   "processes for training.gpus > 1), without a server.",
                       epilog="A run spec is one recipe's run (docs/INTERFACES.md has every key), e.g.\n"
                              "  model: tiny\n"
                              "  data: {corpus: tinyshakespeare, vocab_size: 1024, seq_len: 128}\n"
                              "  training: {steps: 100, batch_size: 8, lr: 0.003, warmup_steps: 10}\n"
                              "  recipe: fp8_tensorwise\n"
                              "  seed: 0\n"
                              "An experiment (name, several recipes, seeds) is submitted with `plab submit FILE`.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("file", help="the run spec (YAML or JSON)")
    t.add_argument("--recipe", help="override the file's recipe")
    t.add_argument("--output", default="plab-data/train",
                   help="checkpoint folder; the same command resumes the run from its newest checkpoint there "
                        "(default: plab-data/train in the current folder: give each run its own)")
    t.add_argument("--metrics", help="also write metrics to this JSONL file")
    t.add_argument("--no-resume", action="store_true",
                   help="start a new run from step 0; checkpoints of an earlier run in --output are moved to "
                        "checkpoints.before-<time> beside")
    t.add_argument("--print-every", type=whole_number(1), default=10, help="print the loss every N steps (N >= 1)")
    t.add_argument("--result-json", help="also write the result summary to this file")
    t.set_defaults(func=cmd_train)
