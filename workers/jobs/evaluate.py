"""The evaluation job: lm-evaluation-harness on a run's final checkpoint, in its own process.

    python -m workers.jobs.evaluate EVALUATION_ID

Each task's result is posted as soon as it is done, so a long evaluation shows its first tasks early.
"""
from __future__ import annotations

import os
import sys

from plab.settings import get_settings
from workers.client import PlabClient
from workers.jobs import EXIT_OK, EXIT_SKIPPED, UNREPORTED, child_command, child_main, error_message

KIND = "evaluation"
MODULE = "workers.jobs.evaluate"


def command(evaluation_id: int) -> list[str]:
    return child_command(MODULE, evaluation_id)


def status(client: PlabClient, evaluation_id: int) -> str:
    return client.get_evaluation(evaluation_id)["status"]


def mark_failed(client: PlabClient, evaluation_id: int, message: str) -> None:
    client.set_evaluation_status(evaluation_id, "failed", error_message=message)


def validation_text(spec: dict, out: os.PathLike, max_tokens: int = 400_000) -> str | None:
    """The experiment's held-out text (the validation split the loop reports val/loss on), decoded from its
    token shard, for the held-out bits-per-byte task. None for synthetic corpora."""
    from pathlib import Path

    from training.config import RANDOM_CORPUS, RunSpec, plab_home
    from training.setup import open_token_dataset

    rs = RunSpec.from_dict(spec)
    if rs.data.corpus == RANDOM_CORPUS:
        return None
    out = Path(out)
    if not out.is_file():
        tok, ds = open_token_dataset(rs, plab_home() / "cache")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(tok.decode(ds.val[:max_tokens].tolist()))
        tmp.replace(out)
    return str(out)


def trained_context(spec: dict) -> int | None:
    """The context a run trained its model on, from its spec, for checkpoints that do not record it (written before
    they did): data.seq_len for a model trained from random weights; None (the checkpoint's own record, else
    lm-eval's max length) for a run continued from a checkpoint, whose model may have learned longer contexts."""
    from training.config import RunSpec, SpecError

    try:
        rs = RunSpec.from_dict(spec, check_paths=False)
    except (SpecError, TypeError, KeyError):
        return None
    return rs.data.seq_len if rs.model.source != "checkpoint" else None


def run(evaluation_id: int) -> int:
    client = PlabClient.from_env()
    job = client.get_evaluation_job(evaluation_id)
    if job["status"] not in UNREPORTED:
        print(f"[plab] evaluation {evaluation_id} is '{job['status']}'; nothing to do")
        return EXIT_SKIPPED
    client.set_evaluation_status(evaluation_id, "running")
    try:
        result = _evaluate(client, evaluation_id, job)
    except BaseException as e:  # noqa: BLE001 - reported, then re-raised as an exit code
        client.set_evaluation_status(evaluation_id, "failed", error_message=error_message(e))
        raise
    client.set_evaluation_status(evaluation_id, "succeeded", lm_eval_version=result.get("lm_eval_version"))
    return EXIT_OK


def _evaluate(client: PlabClient, evaluation_id: int, job: dict) -> dict:
    from training.evaluation import evaluate_checkpoint

    heldout = None
    if any("heldout" in t for t in job["tasks"]):
        heldout = validation_text(job["spec"], get_settings().home / "runs" / str(job["run_id"]) / "validation.txt")
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
