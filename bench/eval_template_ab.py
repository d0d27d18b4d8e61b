"""A/B in one process: lm-eval's own `apply_template` (compiles each Jinja template again for every document)
against the evaluation's compile-once cache (`training.evaluation.adapter._compile_templates_once`).

Evaluates the same checkpoint on the same tasks `--rounds` times in each mode, alternating (plain, cached,
plain, cached, ...), and keeps each task's fastest time per mode, so a first round's dataset loading and file
caches do not favour either side. The metrics of both modes must be equal (the prompts are the same strings);
the script fails if they are not.

    PLAB_DATA_DIR=../shared/data python bench/eval_template_ab.py --preset tiny --device cpu \
        --tasks plab_arc_easy,plab_blimp --limit 200

Without --checkpoint it builds a random-init checkpoint of `--preset` (125m, as eval_bench; tiny on a CPU) with
eval_bench's tokenizer (32,000 BPE tokens on Tiny Shakespeare). Writes
bench/results/eval_template_ab_<device>_<time>.json (and $OUT/eval_template_ab.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchmeta import git_commit, write_result  # noqa: E402


def _metrics(result: dict) -> dict:
    return {name: {m: v["value"] for m, v in task["metrics"].items()} for name, task in result["tasks"].items()}


def run(checkpoint, tasks: str, limit, device: str, batch_size, rounds: int) -> dict:
    from lm_eval import utils

    from training.evaluation import adapter, evaluate_checkpoint

    install = adapter._compile_templates_once
    install()
    fast = utils.apply_template

    def use(cached: bool) -> None:  # what lm-eval calls in the next evaluation, and what the evaluation installs
        utils.apply_template = fast if cached else fast.original
        adapter._compile_templates_once = install if cached else (lambda: None)

    times: dict[str, dict[str, float]] = {"plain": {}, "cached": {}}
    metrics: dict[str, dict] = {}
    try:
        for _ in range(rounds):
            for mode in ("plain", "cached"):
                use(mode == "cached")
                result = evaluate_checkpoint(checkpoint, tasks, limit=limit, device=device, batch_size=batch_size)
                for name in result["requested"]:
                    t = result["tasks"][name]["time_s"]
                    times[mode][name] = min(t, times[mode].get(name, t))
                got = _metrics(result)
                if metrics.setdefault(mode, got) != got:
                    raise SystemExit(f"{mode}: metrics changed between rounds")
    finally:
        use(True)
    if metrics["plain"] != metrics["cached"]:
        raise SystemExit("the cached templates changed a metric: " + json.dumps(metrics, indent=1))
    return {"time_s": times, "speedup": {n: times["plain"][n] / times["cached"][n] for n in times["plain"]},
            "metrics": metrics["cached"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=None, help="HF checkpoint dir (default: a random-init --preset model)")
    parser.add_argument("--preset", default="125m", help="model preset of the random-init checkpoint (e.g. tiny on a CPU)")
    parser.add_argument("--tasks", default="plab_arc_easy,plab_blimp")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (per BLiMP paradigm)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", default=None, help="int or 'auto' (default: the evaluation's)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if not os.environ.get("PLAB_DATA_DIR"):
        parser.error("set PLAB_DATA_DIR to the data directory")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    batch_size = None if args.batch_size is None else (args.batch_size if args.batch_size == "auto"
                                                       else int(args.batch_size))
    import torch

    device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    with tempfile.TemporaryDirectory(prefix="plab-eval-ab-") as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from bench.eval_bench import build_checkpoint
            checkpoint = Path(tmp) / f"ckpt-{args.preset}"
            build_checkpoint(checkpoint, "tinyshakespeare", 32000, 2048, preset=args.preset)
        ab = run(checkpoint, args.tasks, args.limit, args.device, batch_size, args.rounds)

    print(f"\n{'task':<24} {'plain s':>8} {'cached s':>9} {'speedup':>8}   (fastest of {args.rounds} per mode)")
    for name, plain in ab["time_s"]["plain"].items():
        print(f"{name:<24} {plain:8.1f} {ab['time_s']['cached'][name]:9.1f} {ab['speedup'][name]:7.2f}x")
    summary = {"bench": "eval_template_ab", "date": dt.datetime.now(dt.timezone.utc).isoformat(),
               "device": device_name, "cpu_threads": torch.get_num_threads(), "git_commit": git_commit(),
               "checkpoint": str(args.checkpoint or f"random-init {args.preset}, vocabulary 32000"),
               "tasks": args.tasks, "limit": args.limit, "rounds": args.rounds, **ab}
    write_result(summary, "eval_template_ab", device_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
