"""``plab eval``: list tasks, evaluate a checkpoint directory, render tasks, compare two results.

    plab eval --list-tasks [--all] [--json]
    plab eval CHECKPOINT_DIR [--tasks plab_piqa,plab_blimp] [--limit N] [--output results.json]
    plab eval --render-tasks DIR      # resolved YAMLs for `lm_eval --include_path`
    plab eval --compare BASELINE.json CANDIDATE.json [--method mcnemar]
"""

from __future__ import annotations

import argparse
import json
import os
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .adapter import EvaluationError, evaluate_checkpoint, list_tasks
from .limits import document_limit_arg
from .stats import compare_results
from .taskdirs import SHIPPED_TASKS, TaskConfigError, render_task_dirs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plab eval",
        description="Evaluate an HF-format checkpoint with lm-evaluation-harness on plab and user tasks.",
        epilog="A run of the lab instead of a folder: `plab eval RUN_ID --tasks a,b [--limit N] [--wait] "
               "[--api-url URL]` queues the evaluation of the run's final checkpoint as a worker job through the "
               "API (its results land on the experiment's page); --wait prints them when the job ends.",
    )
    parser.add_argument("target", nargs="?", help="checkpoint directory (config.json + weights + tokenizer), or a "
                                                  "run id (see below)")
    parser.add_argument("--list-tasks", action="store_true", help="list the available tasks and exit")
    parser.add_argument("--all", action="store_true", help="with --list-tasks: include lm-eval's built-in tasks")
    parser.add_argument("--json", action="store_true", help="with --list-tasks/--compare: print JSON")
    parser.add_argument("--tasks", default=",".join(SHIPPED_TASKS), help="comma-separated task names (default: all shipped)")
    parser.add_argument("--limit", type=document_limit_arg, default=None, help="documents per task (a whole number), or a fraction of each task's documents in (0, 1), as lm-eval's --limit")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--batch-size", type=_batch_size, default=None, help="int or 'auto' (default 64 on CUDA, 8 on CPU)")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--tasks-dir", default=None, help="user task directory (default: $PLAB_EVAL_TASKS_DIR)")
    parser.add_argument("--data-dir", default=None, help="data directory (default: $PLAB_DATA_DIR)")
    parser.add_argument("--heldout-text", default=None, help="validation text for plab_heldout_bpb (default: $PLAB_EVAL_HELDOUT_TEXT)")
    parser.add_argument("--rolling-context", type=_tokens, default=None, metavar="N",
                        help="window length (tokens) of perplexity tasks such as plab_heldout_bpb (default: the "
                             "context the checkpoint records it was trained on, else the model's max length)")
    parser.add_argument("--online", action="store_true", help="allow Hugging Face downloads (lm-eval's own tasks)")
    parser.add_argument("--output", default=None, help="write the full results (with per-sample scores) as JSON here")
    parser.add_argument("--render-tasks", metavar="DIR", default=None, help="write resolved task YAMLs into DIR and exit")
    parser.add_argument("--compare", nargs=2, metavar=("BASELINE", "CANDIDATE"), help="paired comparison of two results JSON files")
    parser.add_argument("--method", default="bootstrap", choices=("bootstrap", "mcnemar"), help="with --compare")
    return parser


def main(argv: Sequence[str] | None = None, *, resolve_target: Callable[[str], str] | None = None) -> int:
    """Run ``plab eval``; returns the exit status (0 ok, 2 bad input).

    ``resolve_target`` lets the caller map a positional that is not a directory (a run id)
    to a checkpoint directory.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    modes = [flag for flag, on in (("--list-tasks", args.list_tasks), ("--render-tasks", args.render_tasks),
                                   ("--compare", args.compare)) if on]
    if len(modes) > 1:
        parser.error(f"{' and '.join(modes)} are separate commands: give one of them")
    if modes and args.target:
        parser.error(f"{modes[0]} takes no checkpoint ({args.target!r}): give the checkpoint alone to evaluate it")
    try:
        if args.list_tasks:
            return _print_tasks(list_tasks(args.tasks_dir, include_lm_eval=args.all), as_json=args.json)
        if args.render_tasks:
            rendered = render_task_dirs(
                args.render_tasks, data_dir=args.data_dir, heldout_text=args.heldout_text, tasks_dir=args.tasks_dir
            )
            print(",".join(str(p) for p in rendered.include_paths))
            return 0
        if args.compare:
            base, cand = (_read_results(p, which) for p, which in zip(args.compare, ("BASELINE", "CANDIDATE")))
            shared = _compared_tasks(base, cand)
            if not shared:
                raise ValueError(f"{args.compare[0]} and {args.compare[1]} share no evaluated task: evaluate both "
                                 "checkpoints on the same tasks")
            # The Holm family is the tasks that were asked for (a group's subtasks are rows of their own but not
            # members of the family), as on the dashboard: the same two files give the same corrected p there.
            rows = compare_results(base, cand, tasks=shared, method=args.method)
            print(json.dumps(rows, indent=2) if args.json else _format_comparison(rows))
            return 0
        if not args.target:
            parser.error("give a checkpoint directory, or --list-tasks / --render-tasks / --compare")
        target = args.target
        _check_output(args.output)  # before hours of evaluation, not after
        if resolve_target is not None and not Path(target).exists():
            target = resolve_target(target)
        result = evaluate_checkpoint(
            target,
            args.tasks,
            limit=args.limit,
            device=args.device,
            batch_size=args.batch_size,
            dtype=args.dtype,
            tasks_dir=args.tasks_dir,
            data_dir=args.data_dir,
            heldout_text=args.heldout_text,
            offline=not args.online,
            rolling_context=args.rolling_context,
        )
    except (EvaluationError, TaskConfigError, ValueError, OSError) as err:
        print(f"plab eval: error: {err}", file=sys.stderr)
        return 2
    print(_format_results(result))
    if args.output:
        return _write_output(args.output, result)
    return 0


def _read_results(path: str, which: str) -> dict:
    """A results file of `plab eval --output`, or a ValueError naming the file and what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"--compare {which} {path}: cannot read it ({err.strerror or err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--compare {which} {path}: not JSON ({err}); give a file written by plab eval "
                         "--output") from None
    tasks = data.get("tasks") if isinstance(data, dict) else None
    if not isinstance(tasks, dict) or not tasks or not all(isinstance(t, dict) for t in tasks.values()):
        raise ValueError(f"--compare {which} {path}: not the results of plab eval --output (an object whose "
                         "\"tasks\" maps each task to its result)")
    return data


def _compared_tasks(base: dict, cand: dict) -> list[str]:
    """The tasks both results hold, in the order the baseline's evaluation asked for them (its `requested`; all
    of its tasks for a file without that list)."""
    requested = base.get("requested") if isinstance(base.get("requested"), list) else list(base["tasks"])
    return [t for t in requested if t in base["tasks"] and t in cand["tasks"]]


def _check_output(output: str | None) -> None:
    """An --output file can be written: its folder is made if missing; a folder or unwritable place is an
    error (OSError) before anything is evaluated."""
    from training.outputs import output_problem

    if not output:
        return
    if Path(output).is_dir():
        raise OSError(f"--output {output} is a folder; give a file name such as {Path(output) / 'results.json'}")
    problem = output_problem(output, folder=False)
    if problem:
        raise OSError(f"--output {output}: {problem}")


def _write_output(output: str, result: dict) -> int:
    """The results as JSON in `output`; if that fails after all, in a temporary file, so nothing is lost."""
    text = json.dumps(result, indent=1)
    try:
        Path(output).write_text(text)
        return 0
    except OSError as err:
        import tempfile

        fd, fallback = tempfile.mkstemp(prefix="plab-eval-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        print(f"plab eval: could not write {output} ({err}); the results are in {fallback}", file=sys.stderr)
        return 1


def _tokens(text: str) -> int:
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"--rolling-context wants a whole number of tokens >= 2 (e.g. the run's "
                                         f"data.seq_len), got {text!r}")
    return int(text)


def _batch_size(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--batch-size wants a positive integer or 'auto', got {text!r}")
    return int(text)


def _print_tasks(tasks: list[dict], *, as_json: bool) -> int:
    if as_json:
        print(json.dumps(tasks, indent=1))
        return 0
    grouped = {t["name"] for t in tasks if t.get("groups")}
    for t in tasks:
        if t["name"] in grouped:
            continue  # shown as a count under its group
        if t["kind"] == "invalid":
            print(f"{t['name']:<40} INVALID  {t['path']}: {t['error']}")
            continue
        detail = f"group of {len(t['subtasks'])}" if t["kind"] in ("group", "tag") else t.get("output_type", "")
        print(f"{t['name']:<40} {t['source']:<8} {detail:<24} {t['path'] or ''}")
    return 0


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:.{digits}g}" if abs(value) >= 1e4 else f"{value:.{digits}f}"


def _format_results(result: dict) -> str:
    lines = [f"lm-eval {result['lm_eval_version']}  {result['checkpoint_dir']}  device={result['device']} dtype={result['dtype']}"]
    lines.append(f"{'task':<32} {'metric':<16} {'value':>12} {'stderr':>10} {'n':>6} {'time_s':>8}")
    for name in result["requested"]:
        task = result["tasks"][name]
        for metric, m in task["metrics"].items():
            lines.append(
                f"{name:<32} {metric:<16} {_fmt(m['value']):>12} {_fmt(m['stderr']):>10} "
                f"{task['n_samples']:>6} {_fmt(task['time_s'], 1):>8}"
            )
    lines.append(f"model load {result['load_time_s']:.1f} s, total {result['total_time_s']:.1f} s")
    return "\n".join(lines)


def _format_comparison(rows: list[dict]) -> str:
    lines = [f"{'task':<32} {'metric':<16} {'baseline':>10} {'candidate':>10} {'delta':>9} {'95% CI':>22} {'p':>7} "
             f"{'p Holm':>7}  method"]
    for r in rows:
        ci = f"[{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]"
        mark = " *" if r["significant"] else ""
        lines.append(
            f"{r['task']:<32} {r['metric']:<16} {_fmt(r['baseline']):>10} {_fmt(r['candidate']):>10} "
            f"{_fmt(r['delta']):>9} {ci:>22} {_fmt(r['p_value'], 3):>7} {_fmt(r['p_holm'], 3):>7}  {r['method']}{mark}"
        )
    if rows:
        n = f"{len(rows)} row{'s' if len(rows) != 1 else ''}"
        lines.append(f"* significant after Holm's correction over the {n} (family-wise alpha {rows[0]['alpha']:g}); "
                     "intervals cover document sampling of these two checkpoints, not seeds")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
