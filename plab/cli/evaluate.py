"""`plab eval`: lm-evaluation-harness on a checkpoint folder here, or on a run's final checkpoint as a worker job."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from plab.cli.common import UsageError


def cmd_eval(argv: list[str]) -> int:
    """`plab eval RUN_ID --tasks a,b [--limit N] [--wait]` starts an evaluation job through the API; anything else
    (a checkpoint folder, --list-tasks, --compare) is the local lm-eval front end of training.evaluation."""
    from training.evaluation import main as eval_main

    if argv and argv[0].isdigit() and not Path(argv[0]).exists():
        return _eval_run_via_api(argv)
    return eval_main(argv) or 0


def _eval_run_via_api(argv: list[str]) -> int:
    from workers.client import ApiError, PlabClient

    p = argparse.ArgumentParser(prog="plab eval RUN_ID", description="evaluate a run's checkpoint on the workers")
    p.add_argument("run_id", type=int)
    p.add_argument("--tasks", required=True, help="comma-separated, e.g. plab_blimp,plab_lambada_openai")
    p.add_argument("--limit", type=int, help="documents per task")
    p.add_argument("--wait", action="store_true", help="wait for the job and print its results")
    p.add_argument("--api-url")
    a = p.parse_args(argv)
    client = PlabClient.from_env(a.api_url)
    try:
        ev = client.create_evaluation(a.run_id, [t for t in a.tasks.split(",") if t], a.limit)
    except ApiError as e:
        raise UsageError(e.message) from e
    print(f"evaluation {ev['id']} of run {a.run_id} queued: {', '.join(ev['tasks'])}")
    if not a.wait:
        return 0
    while ev["status"] in ("queued", "running"):
        time.sleep(2)
        ev = client.get_evaluation(ev["id"])
    for r in ev["results"]:
        shown = ", ".join(f"{m} {v.get('value'):.4f}" for m, v in (r["metrics"].get("metrics") or {}).items()
                          if isinstance(v, dict) and v.get("value") is not None)
        print(f"  {r['task']:<28} {shown}")
    print(f"status: {ev['status']}" + (f" ({ev['error_message']})" if ev.get("error_message") else ""))
    return 0 if ev["status"] == "succeeded" else 1
