"""lm-eval jobs on run checkpoints, their per-task results, and the paired comparison against BF16."""
from __future__ import annotations

import hashlib
import threading

from sqlalchemy import Text, cast, func, select
from sqlalchemy.orm import Session

from backend.models import Artifact, EvalResult, Evaluation, Run, utcnow
from backend.schemas import EvalResultOut, EvaluationOut, EvaluationStatusUpdate, EvalTaskResultIn, check_eval_result
from backend.errors import Conflict, InvalidInput, NotFound
from backend.services import leases
from backend.services.comparison import baseline_run
from backend.services.runs import get_experiment, get_run

EVAL_TRANSITIONS = {"queued": {"running", "failed"}, "running": {"running", "succeeded", "failed"}}
EVAL_ENDED = ("succeeded", "failed")


def checkpoint_of(session: Session, run_id: int) -> str | None:
    art = session.scalars(select(Artifact).where(Artifact.run_id == run_id, Artifact.kind == "checkpoint")
                          .order_by(Artifact.step.desc().nulls_last(), Artifact.id.desc()).limit(1)).first()
    return art.path if art else None


def create_evaluation(session: Session, run_id: int, tasks: list[str], limit: int | None) -> Evaluation:
    run = get_run(session, run_id)
    if run.status != "succeeded":
        raise Conflict(f"run {run_id} is '{run.status}': only a run that succeeded has a final checkpoint to "
                       "evaluate")
    if checkpoint_of(session, run_id) is None:
        raise Conflict(f"run {run_id} has no checkpoint artifact to evaluate")
    ev = Evaluation(run_id=run_id, tasks=tasks, limit=limit, status="queued")
    session.add(ev)
    session.flush()
    return ev


def automatic_evaluation(session: Session, run: Run) -> Evaluation | None:
    """The experiment's `eval_tasks` on a run of ours that has just succeeded, as a queued evaluation; None when
    the experiment asks for none or the run left no checkpoint (an external run is its owner's to evaluate)."""
    tasks = run.experiment.eval_tasks if run.status == "succeeded" and not run.external else []
    if not tasks or checkpoint_of(session, run.id) is None:
        return None
    return create_evaluation(session, run.id, list(tasks), None)


def get_evaluation(session: Session, evaluation_id: int, lock: bool = False) -> Evaluation:
    ev = session.get(Evaluation, evaluation_id, with_for_update=lock)
    if ev is None:
        raise NotFound(f"evaluation {evaluation_id} does not exist")
    return ev


def job_of(session: Session, evaluation_id: int) -> dict:
    """What a worker needs to run an evaluation: the checkpoint, the tasks, the run's spec."""
    ev = get_evaluation(session, evaluation_id)
    run = get_run(session, ev.run_id)
    return {"evaluation_id": ev.id, "run_id": run.id, "tasks": ev.tasks, "limit": ev.limit, "status": ev.status,
            "checkpoint": checkpoint_of(session, run.id), "spec": run.spec}


def evaluation_out(session: Session, ev: Evaluation) -> EvaluationOut:
    results = session.scalars(select(EvalResult).where(EvalResult.evaluation_id == ev.id)
                              .order_by(EvalResult.id)).all()
    out = EvaluationOut.model_validate(ev)
    out.results = [EvalResultOut.model_validate(r) for r in results]
    return out


def list_evaluations(session: Session, run_id: int) -> list[Evaluation]:
    get_run(session, run_id)
    return list(session.scalars(select(Evaluation).where(Evaluation.run_id == run_id).order_by(Evaluation.id)))


def update_status(session: Session, evaluation_id: int, body: EvaluationStatusUpdate,
                  stale_s: float = 60.0) -> Evaluation:
    """A worker's report. `running` claims the evaluation for its job (`leases.claim`: 409 while another job
    holds it)."""
    ev = get_evaluation(session, evaluation_id, lock=body.status == "running")  # as a heartbeat locks it
    if body.status not in EVAL_TRANSITIONS.get(ev.status, set()):
        raise Conflict(f"evaluation {evaluation_id} cannot go from '{ev.status}' to '{body.status}'")
    if body.status == "running":
        leases.claim(ev, stale_s, body.worker_host, "evaluation")
    ev.status = body.status
    if body.error_message is not None:
        ev.error_message = body.error_message
    if body.lm_eval_version is not None:
        ev.lm_eval_version = body.lm_eval_version
    if body.status in ("succeeded", "failed"):
        ev.finished_at = utcnow()
    return ev


def heartbeat(session: Session, evaluation_id: int, holder: str | None = None) -> Evaluation:
    """A running evaluation's lease renewed (its job beats while lm-eval scores the tasks; a job naming itself
    renews only its own lease)."""
    return leases.renew(session, Evaluation, evaluation_id, "evaluation", holder)


def post_result(session: Session, evaluation_id: int, body: EvalTaskResultIn) -> EvalResult:
    """A worker's result of one task (POST /evaluations/{id}/results): taken while the evaluation is queued or
    running (re-posting a task replaces it: a retried job must not duplicate); 409 once it has ended, whose results
    are what the accuracy table and the verdict were computed from. 422 for fields that disagree with each other
    (`check_eval_result`), 409 for a group that would lead back to itself through the run's stored groups."""
    ev = session.get(Evaluation, evaluation_id, with_for_update=True)  # a status report waits for this post
    if ev is None:
        raise NotFound(f"evaluation {evaluation_id} does not exist")
    if ev.status in EVAL_ENDED:
        raise Conflict(f"evaluation {evaluation_id} has already ended ('{ev.status}'): its stored results can no "
                       "longer change; post results before reporting the final status, or start a new evaluation "
                       f"(POST /api/v1/runs/{ev.run_id}/evaluations)")
    try:
        check_eval_result(body.task, body.result)
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    if body.result.get("subtasks"):
        _refuse_cycle(session, ev, body.task, list(body.result["subtasks"]))
    return store_result(session, evaluation_id, body)


def _refuse_cycle(session: Session, ev: Evaluation, task: str, subtasks: list[str]) -> None:
    """Conflict when `task`'s subtasks lead back to it through the groups stored for the run (by the evaluations
    that have not failed, a later evaluation's definition of a task replacing an earlier one's)."""
    rows = session.execute(select(EvalResult.task, EvalResult.metrics).join(Evaluation)
                           .where(EvalResult.run_id == ev.run_id, Evaluation.status != "failed")
                           .order_by(Evaluation.id)).all()
    graph = {name: _subtasks_of(metrics) for name, metrics in rows}
    graph[task] = subtasks
    cycle = _cycle_through(graph, task)
    if cycle:
        raise Conflict(f"group {task} would contain itself: {' -> '.join(cycle)} (subtasks stored for run "
                       f"{ev.run_id}); a group's subtasks must not lead back to it")


def _subtasks_of(entry) -> list[str]:
    subs = entry.get("subtasks") if isinstance(entry, dict) else None
    return [s for s in subs if isinstance(s, str)] if isinstance(subs, list) else []


def _cycle_through(graph: dict[str, list[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start along `graph` (task -> its subtasks), or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for sub in graph.get(node, []):
            if sub == start:
                return path + [start]
            if sub not in seen:
                seen.add(sub)
                stack.append((sub, path + [sub]))
    return None


def _first_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    for task in graph:
        cycle = _cycle_through(graph, task)
        if cycle:
            return cycle
    return None


def store_result(session: Session, evaluation_id: int, body: EvalTaskResultIn) -> EvalResult:
    """One task's result stored, whatever the evaluation's status (the API's way in is `post_result`, which refuses
    an ended evaluation); re-posting the same task replaces it (a retried job must not duplicate)."""
    ev = get_evaluation(session, evaluation_id)
    result = dict(body.result)
    samples = result.pop("samples", None) or {}
    row = session.scalars(select(EvalResult).where(EvalResult.evaluation_id == ev.id,
                                                   EvalResult.task == body.task)).first()
    if row is None:
        row = EvalResult(evaluation_id=ev.id, run_id=ev.run_id, task=body.task)
        session.add(row)
    row.metrics, row.samples = result, samples
    row.task_hash = result.get("task_hash")
    row.duration_s = result.get("time_s")
    session.flush()
    return row


def latest_results(session: Session, run_id: int) -> dict[str, dict]:
    """task -> the evaluate_checkpoint task entry (samples included) from the newest finished evaluation."""
    rows = session.execute(
        select(EvalResult).join(Evaluation).where(EvalResult.run_id == run_id, Evaluation.status == "succeeded")
        .order_by(Evaluation.id)).scalars().all()
    out: dict[str, dict] = {}
    for r in rows:  # later evaluations overwrite earlier ones
        out[r.task] = {**r.metrics, "samples": r.samples}
    return out


# Accuracy tables by everything they are computed from (the experiment's baseline, its runs' recipe, label, status
# and backend, every evaluation and stored result row with a digest of its content, the method): a table costs a
# bootstrap of DEFAULT_N_BOOT resamples per task and run, and the page and the verdict ask for it on every poll.
_TABLES: dict[tuple, dict] = {}
_TABLES_KEPT = 32
_TABLES_LOCK = threading.Lock()  # FastAPI runs sync routes on a thread pool


def _table_signature(session: Session, exp, method: str) -> tuple:
    results = _result_digests(session, exp.id)
    evals = session.execute(
        select(Evaluation.id, Evaluation.status).join(Run, Run.id == Evaluation.run_id)
        .where(Run.experiment_id == exp.id).order_by(Evaluation.id)).all()
    runs = tuple((r.id, r.recipe, r.label, r.status, r.gemm_backend, r.bf16_first_layers, r.bf16_last_layers)
                 for r in exp.runs)
    return (str(session.get_bind().url), exp.id, exp.baseline, method, runs, results, tuple(map(tuple, evals)))


def _result_digests(session: Session, experiment_id: int) -> tuple:
    """(id, evaluation id, digest of the stored metrics) of every result row of the experiment: a row replaced in
    place (a retried task of a running evaluation; an ended one takes no result) keeps its id, so the id alone
    served a table computed from its former content. The rows have no updated_at column. The metrics - the
    aggregates of the samples, small - are digested rather than the samples (megabytes for BLiMP, read on every
    poll of the page otherwise): md5 in the database on PostgreSQL, sha256 of the stored text on SQLite."""
    where = (Run.experiment_id == experiment_id,)
    base = select(EvalResult.id, EvalResult.evaluation_id).join(Run, Run.id == EvalResult.run_id)
    if session.get_bind().dialect.name == "postgresql":
        digest = func.md5(cast(EvalResult.metrics, Text))
        return tuple(map(tuple, session.execute(base.add_columns(digest).where(*where).order_by(EvalResult.id))))
    rows = session.execute(base.add_columns(cast(EvalResult.metrics, Text)).where(*where).order_by(EvalResult.id))
    return tuple((rid, eid, hashlib.sha256(str(m).encode()).hexdigest()) for rid, eid, m in rows)


def accuracy_table(session: Session, experiment_id: int, *, method: str = "bootstrap") -> dict:
    """Tasks x recipes: value ± stderr, and per run the paired delta to the experiment's baseline run (BF16) with
    its 95% interval and its Holm-corrected significance (over the run's tasks), under the key `vs_bf16` that the
    dashboard reads. Conflict (409) when a run and the baseline scored different documents (the reason says which
    task and how): a paired test on different documents would measure the documents."""
    key = _table_signature(session, get_experiment(session, experiment_id), method)
    with _TABLES_LOCK:
        table = _TABLES.get(key)
    if table is None:
        table = _accuracy_table(session, experiment_id, method)  # Conflict (409) for what cannot be compared
        with _TABLES_LOCK:
            if len(_TABLES) >= _TABLES_KEPT:
                _TABLES.pop(next(iter(_TABLES)))
            _TABLES[key] = table
    return table


def _accuracy_table(session: Session, experiment_id: int, method: str) -> dict:
    from training.evaluation.stats import DEFAULT_N_BOOT, PairingError, compare_results

    exp = get_experiment(session, experiment_id)
    runs: list[Run] = list(exp.runs)
    per_run = {r.id: latest_results(session, r.id) for r in runs}
    # The reference is the one the loss comparison uses (the baseline's first seed), when it was evaluated.
    base = baseline_run([r for r in runs if per_run[r.id]], exp.baseline)
    for r in runs:  # stored before groups were checked: the paired test would recurse without end
        cycle = _first_cycle({t: _subtasks_of(e) for t, e in per_run[r.id].items() if e.get("kind") == "group"})
        if cycle:
            raise Conflict(f"run {r.id} ({r.label}) has a stored evaluation group that contains itself "
                           f"({' -> '.join(cycle)}); evaluate its checkpoint again (POST "
                           f"/api/v1/runs/{r.id}/evaluations) to replace those results")
    table = []
    for r in runs:
        res = per_run[r.id]
        # Subtasks of a group (BLiMP's 67 paradigms) are stored for the paired test; the table shows what was asked.
        requested = {t for ev in session.scalars(select(Evaluation).where(Evaluation.run_id == r.id)) for t in ev.tasks}
        shown = [t for t in res if t in requested] or list(res)
        try:
            values = {task: dict(res[task].get("metrics") or {}) for task in shown}
        except (TypeError, ValueError, AttributeError) as e:
            raise Conflict(f"run {r.id} ({r.label}) has a stored evaluation result whose metrics are not an object "
                           f"({e}); evaluate its checkpoint again (POST /api/v1/runs/{r.id}/evaluations)") from e
        comparison = []
        if base is not None and r.id != base.id and res:
            shared = [t for t in shown if t in per_run[base.id]]
            if shared:
                try:
                    comparison = compare_results(per_run[base.id], res, tasks=shared, method=method,
                                                 n_boot=DEFAULT_N_BOOT)
                except PairingError as e:
                    raise Conflict(f"run {r.id} ({r.label}) cannot be paired with the {exp.baseline} run {base.id}: "
                                   f"{e}") from e
                except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
                    # Results stored before their shape was checked (or that the statistics refuse): say which.
                    raise Conflict(f"run {r.id} ({r.label}) cannot be compared with the {exp.baseline} run {base.id}: "
                                   f"{_stored_result_problem(e)}; evaluate both checkpoints again (POST "
                                   "/api/v1/runs/<id>/evaluations) so that their results can be paired") from e
        table.append({"run_id": r.id, "recipe": r.recipe, "label": r.label, "status": r.status,
                      "gemm_backend": r.gemm_backend, "tasks": values, "vs_bf16": comparison})
    return {"experiment_id": exp.id, "baseline_run_id": base.id if base else None, "method": method,
            "confidence": 0.95, "n_boot": DEFAULT_N_BOOT, "correction": "holm",
            "seed_replicates": len([r for r in runs if r.recipe == exp.baseline and per_run[r.id]]) > 1,
            "interval_covers": "the sampling of documents for these checkpoints; seed-to-seed variation only where "
                               "the baseline has seed replicates (their spread is shown beside each difference)",
            "runs": table}


def _stored_result_problem(e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"a stored evaluation result lacks the field {e.args[0]!r} the paired test reads"
    if isinstance(e, RecursionError):
        return "a stored evaluation group nests too deeply"
    if isinstance(e, ValueError):
        return str(e)
    return f"a stored evaluation result is malformed ({type(e).__name__}: {e})"
