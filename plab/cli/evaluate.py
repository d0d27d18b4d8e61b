"""`plab eval`: lm-evaluation-harness on a checkpoint folder here, or on a run's final checkpoint as a worker job."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from plab.cli.common import UsageError, api_call, document_limit

# `--wait`: how long an evaluation may stay queued before the wait says what may be wrong
QUEUED_HINT_S = 300.0


def cmd_eval(argv: list[str]) -> int:
    """`plab eval RUN_ID --tasks a,b [--limit N|FRACTION] [--wait]` starts an evaluation job through the API; anything else
    (a checkpoint folder, --list-tasks, --compare) is the local lm-eval front end of training.evaluation."""
    from training.evaluation import main as eval_main

    if argv and argv[0].isdigit() and not Path(argv[0]).exists():
        return _eval_run_via_api(argv)
    return eval_main(argv) or 0


def _eval_run_via_api(argv: list[str]) -> int:
    from workers.client import PlabClient

    p = argparse.ArgumentParser(prog="plab eval RUN_ID", description="evaluate a run's checkpoint on the workers")
    p.add_argument("run_id", type=int)
    p.add_argument("--tasks", required=True, help="comma-separated, e.g. plab_blimp,plab_lambada_openai")
    p.add_argument("--limit", type=document_limit,
                   help="documents per task, or a fraction of each task's documents such as 0.1 (lm-eval's --limit)")
    p.add_argument("--wait", action="store_true", help="wait for the job and print its results")
    p.add_argument("--api-url")
    a = p.parse_args(argv)
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if not tasks:
        raise UsageError("--tasks names no task; give e.g. --tasks plab_blimp,plab_lambada_openai "
                         "(plab eval --list-tasks lists them)")
    client = PlabClient.from_env(a.api_url, retries=2)
    with api_call(client.base_url, f"an evaluation of run {a.run_id}"):
        ev = client.create_evaluation(a.run_id, tasks, a.limit)
    print(f"evaluation {ev['id']} of run {a.run_id} queued: {', '.join(ev['tasks'])}")
    if not a.wait:
        return 0
    client.retries = 5  # waiting: a server restarting meanwhile is waited for (~15 s), as the workers wait
    since, hinted = time.monotonic(), False
    while ev["status"] in ("queued", "running"):
        time.sleep(2)
        with api_call(client.base_url, f"reading evaluation {ev['id']}"):
            ev = client.get_evaluation(ev["id"])
        if ev["status"] == "queued" and not hinted and time.monotonic() - since >= QUEUED_HINT_S:
            hinted = True
            print(f"evaluation {ev['id']} is still queued after {QUEUED_HINT_S / 60:g} minutes: no worker has taken "
                  f"it. Is a worker running (plab worker), and does one take the 'default' queue? (A message the "
                  f"broker lost is sent again by the API's reconciler.) Still waiting (Ctrl-C stops waiting; the "
                  f"evaluation stays queued)", flush=True)
    for r in ev["results"]:
        shown = ", ".join(f"{m} {v.get('value'):.4f}" for m, v in (r["metrics"].get("metrics") or {}).items()
                          if isinstance(v, dict) and v.get("value") is not None)
        print(f"  {r['task']:<28} {shown}")
    print(f"status: {ev['status']}" + (f" ({ev['error_message']})" if ev.get("error_message") else ""))
    return 0 if ev["status"] == "succeeded" else 1
