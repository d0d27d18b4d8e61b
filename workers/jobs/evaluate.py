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


HELDOUT_CHUNK_TOKENS = 8192  # the pieces of a spread held-out text: whole ~4 KiB documents of the bpb task, several


def heldout_slices(n_val: int, max_tokens: int, rule: str) -> list[slice]:
    """Which tokens of a validation split of `n_val` tokens the held-out text is made of: all of them when they fit
    in `max_tokens`; else the first `max_tokens` (data.val_windows "first", as before it existed) or
    max_tokens // HELDOUT_CHUNK_TOKENS chunks, each in the middle of one of as many equal parts of the split
    ("spread", as the val loss's windows: every file's held-out part, not the first books')."""
    if n_val <= max_tokens:
        return [slice(0, n_val)]
    if rule == "first":
        return [slice(0, max_tokens)]
    from training.data import spread_slots

    size = HELDOUT_CHUNK_TOKENS
    slots = spread_slots(n_val // size, max(max_tokens // size, 1))
    return [slice(int(slot) * size, (int(slot) + 1) * size) for slot in slots]


def validation_file(home, run_id: int, spec: dict):
    """Where the worker keeps a run's held-out text: one file per window rule (a text made by the other rule is
    never reused for it)."""
    from pathlib import Path

    from training.config import RunSpec

    rule = RunSpec.from_dict(spec, check_paths=False).data.val_windows  # the rule validation_text applies
    return Path(home) / "runs" / str(run_id) / ("validation.txt" if rule == "first" else f"validation_{rule}.txt")


def _documents_text(tok, ids: list[int]) -> str:
    """Token ids of packed documents as text: each document decoded on its own, a blank line between them - not the
    separators' own text ("<|endoftext|>" would be scored as a special token and counted as 13 bytes)."""
    special = {t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None}
    documents, current = [], []
    for i in ids:
        if i in special:
            documents.append(current)
            current = []
        else:
            current.append(i)
    documents.append(current)
    return "\n\n".join(text for text in (tok.decode(d) for d in documents if d) if text.strip())


def validation_text(spec: dict, out: os.PathLike, max_tokens: int = 400_000) -> str | None:
    """The experiment's held-out text (the validation split the loop reports val/loss on), decoded from its
    token shard, for the held-out bits-per-byte task: under data.val_windows "spread", `heldout_slices` of it, its
    pieces and documents joined by a blank line; under "first" (runs stored before the rule existed), its first
    `max_tokens` decoded as they always were (separators' text included), so their results stay paired with earlier
    ones. None for synthetic corpora."""
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
        if rs.data.val_windows == "first":  # the text as it always was, byte for byte: results stay paired
            tmp.write_text(tok.decode(ds.val[:max_tokens].tolist()))
        else:
            pieces = heldout_slices(len(ds.val), max_tokens, rs.data.val_windows)
            tmp.write_text("\n\n".join(_documents_text(tok, ds.val[piece].tolist()) for piece in pieces))
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
