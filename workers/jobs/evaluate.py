"""The evaluation job: lm-evaluation-harness on a run's final checkpoint, in its own process.

    python -m workers.jobs.evaluate EVALUATION_ID

Each task's result is posted as soon as it is done, so a long evaluation shows its first tasks early.
"""
from __future__ import annotations

import sys

from plab.settings import get_settings
from training.evaluation.heldout import trained_context, validation_text
from workers.client import PlabClient
from workers.jobs import (EXIT_OK, EXIT_SKIPPED, UNREPORTED, child_command, child_main, claimed, error_message,
                          holder, lost)
from workers.jobs.lease import Heartbeat

KIND = "evaluation"
MODULE = "workers.jobs.evaluate"


def command(evaluation_id: int) -> list[str]:
    return child_command(MODULE, evaluation_id)


def record(client: PlabClient, evaluation_id: int) -> dict:
    return client.get_evaluation(evaluation_id)


def status(client: PlabClient, evaluation_id: int) -> str:
    return record(client, evaluation_id)["status"]


def mark_failed(client: PlabClient, evaluation_id: int, message: str) -> None:
    client.set_evaluation_status(evaluation_id, "failed", error_message=message)


def validation_file(home, run_id: int, spec: dict):
    """Where the worker keeps a run's held-out text: one file per window rule (a text made by the other rule is
    never reused for it)."""
    from pathlib import Path

    from training.config import RunSpec

    rule = RunSpec.from_dict(spec, check_paths=False).data.val_windows  # the rule validation_text applies
    return Path(home) / "runs" / str(run_id) / ("validation.txt" if rule == "first" else f"validation_{rule}.txt")


def run(evaluation_id: int) -> int:
    # As patient as a training job (about 10 minutes of retries): a short API outage while lm-eval scored lost the
    # evaluation's work (5 retries, ~15 s) and stored no reason.
    client = PlabClient.from_env(retries=60)
    job = client.get_evaluation_job(evaluation_id)
    if job["status"] not in UNREPORTED:
        print(f"[plab] evaluation {evaluation_id} is '{job['status']}'; nothing to do")
        return EXIT_SKIPPED
    me = holder()
    if not claimed(lambda: client.set_evaluation_status(evaluation_id, "running", worker_host=me), KIND,
                   evaluation_id):
        return EXIT_SKIPPED
    beat = Heartbeat(client, evaluation_id, get_settings().heartbeat_s, holder=me, beat=client.evaluation_heartbeat)
    try:
        result = _evaluate(client, evaluation_id, job)
    except BaseException as e:  # noqa: BLE001 - reported, then re-raised as an exit code
        beat.stop()
        if beat.lost:
            return lost(KIND, evaluation_id)
        client.set_evaluation_status(evaluation_id, "failed", error_message=error_message(e))
        raise
    beat.stop()
    if beat.lost:
        return lost(KIND, evaluation_id)
    client.set_evaluation_status(evaluation_id, "succeeded", lm_eval_version=result.get("lm_eval_version"))
    return EXIT_OK


def _evaluate(client: PlabClient, evaluation_id: int, job: dict) -> dict:
    from training.evaluation import evaluate_checkpoint

    heldout = None
    if any("heldout" in t for t in job["tasks"]):
        heldout = validation_text(job["spec"], validation_file(get_settings().home, job["run_id"], job["spec"]))
    posted: set[str] = set()

    def post_once(task: str, result: dict) -> None:
        client.post_evaluation_result(evaluation_id, task, result)
        posted.add(task)

    from plab.settings import home_path

    result = evaluate_checkpoint(str(home_path(job["checkpoint"], get_settings().home)), job["tasks"], limit=job["limit"], heldout_text=heldout,
                                 on_task_done=post_once, rolling_context=trained_context(job["spec"]))
    # A group (e.g. plab_blimp) carries no per-document scores itself: its subtasks do, and the paired
    # comparison with BF16 needs them, so they are stored too.
    for task, entry in (result.get("tasks") or {}).items():
        if task not in posted:
            post_once(task, entry)
    return result


if __name__ == "__main__":
    sys.exit(child_main(run, MODULE))
