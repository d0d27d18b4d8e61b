"""The user's housekeeping of experiments and runs: names, descriptions, tags and notes; archiving (hidden from
lists by default, restorable); search; and deletion, which removes a run's rows (metrics, rollups, artifacts,
evaluations) and its folder PLAB_HOME/runs/<id> (checkpoints, logs). Files a run recorded outside its folder are
the user's own and are left alone."""
from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import String, cast, delete, func, or_, select
from sqlalchemy.orm import Session, selectinload

from backend.errors import Conflict
from backend.models import Evaluation, Experiment, MetricPoint, MetricRollup, Run, utcnow
from backend.schemas import ExperimentUpdate, Housekeeping, RunInfoUpdate
from backend.services.runs import get_experiment, lock_run, update_info
from plab import run_folder as plab_run_folder

LIVE = ("queued", "running")


def apply(target: Experiment | Run, body: Housekeeping) -> None:
    """Tags, notes and the archive flag of an update onto an experiment or a run (fields left out stay)."""
    if body.tags is not None:
        target.tags = body.tags
    if body.notes is not None:
        target.notes = body.notes
    if body.archived is not None:
        target.archived_at = (target.archived_at or utcnow()) if body.archived else None


def update_experiment(session: Session, experiment_id: int, body: ExperimentUpdate) -> Experiment:
    exp = get_experiment(session, experiment_id)
    if body.name is not None:
        exp.name = body.name
    if body.description is not None:
        exp.description = body.description
    apply(exp, body)
    session.flush()
    return exp


def update_run(session: Session, run_id: int, body: RunInfoUpdate) -> Run:
    """PATCH /runs/{id}: the worker's informational fields and the user's label, tags, notes and archive flag."""
    run = update_info(session, run_id, body)
    if body.label is not None:
        run.label = body.label
    apply(run, body)
    return run


def _like(text: str) -> str:
    """A LIKE pattern matching `text` literally anywhere (its own % and _ escaped with backslash)."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def has_tag(column, tag: str):
    """`column` (a JSON list of strings) holds `tag`: the tag's JSON spelling inside the list's text. Portable
    across SQLite and PostgreSQL, which both render a JSON list of strings with `"` delimiters."""
    return cast(column, String).ilike(_like(json.dumps(tag)), escape="\\")


def list_experiments(session: Session, *, limit: int, offset: int, q: str | None = None, tag: str | None = None,
                     archived: bool = False) -> tuple[int, list[Experiment]]:
    """Newest first. `q` matches the name, description, tags, recipes or model (a preset name or a custom
    model's fields); `tag` one tag exactly (case-insensitively); `archived` lists the archived ones instead."""
    stmt = select(Experiment).where(Experiment.archived_at.is_not(None) if archived else Experiment.archived_at.is_(None))
    if q:
        like = _like(q)
        stmt = stmt.where(or_(*(col.ilike(like, escape="\\") for col in (
            Experiment.name, Experiment.description, cast(Experiment.tags, String), cast(Experiment.recipes, String),
            cast(Experiment.model_config_, String)))))
    if tag:
        stmt = stmt.where(has_tag(Experiment.tags, tag))
    total = session.scalar(select(func.count()).select_from(stmt.subquery()))
    items = session.scalars(stmt.options(selectinload(Experiment.runs)).order_by(Experiment.id.desc())
                            .limit(limit).offset(offset)).all()
    return total, list(items)


def list_runs(session: Session, *, experiment_id: int | None, status: str | None, recipe: str | None,
              q: str | None, limit: int, offset: int, tag: str | None = None,
              archived: bool = False) -> tuple[int, list[Run]]:
    """Newest first, with the housekeeping filters of `runs_filter`."""
    stmt = runs_filter(select(Run), q=q, tag=tag, archived=archived)
    if experiment_id is not None:
        stmt = stmt.where(Run.experiment_id == experiment_id)
    if status:
        stmt = stmt.where(Run.status == status)
    if recipe:
        stmt = stmt.where(Run.recipe == recipe)
    total = session.scalar(select(func.count()).select_from(stmt.subquery()))
    items = session.scalars(stmt.order_by(Run.id.desc()).limit(limit).offset(offset)).all()
    return total, list(items)


def runs_filter(stmt, *, q: str | None, tag: str | None, archived: bool):
    """The housekeeping filters of the runs list: `q` over label, experiment name, error message, tags and recipe;
    `tag` exactly; archived runs (or runs of an archived experiment) only when `archived`."""
    stmt = stmt.join(Experiment, Run.experiment_id == Experiment.id)
    hidden = or_(Run.archived_at.is_not(None), Experiment.archived_at.is_not(None))
    stmt = stmt.where(hidden if archived else ~hidden)
    if q:
        like = _like(q)
        stmt = stmt.where(or_(Run.label.ilike(like, escape="\\"), Experiment.name.ilike(like, escape="\\"),
                              Run.error_message.ilike(like, escape="\\"), Run.recipe.ilike(like, escape="\\"),
                              cast(Run.tags, String).ilike(like, escape="\\")))
    if tag:
        stmt = stmt.where(has_tag(Run.tags, tag))
    return stmt


def run_folder(home: Path, run_id: int) -> Path:
    """Where a run's files live (workers write checkpoints and logs there): PLAB_HOME/runs/<id>."""
    return plab_run_folder.folder_of(home, run_id).resolve()


def _folder_owner(run: Run) -> tuple[dict, bool]:
    """(identity, started before) of the run, read before its row goes: `plab.run_folder.remove` deletes its folder
    only if it is the run's (another database's run <id> may hold it)."""
    return (plab_run_folder.identity(run.id, run.experiment_id, run.created_at),
            not run.external and ((run.attempts or 0) > 0 or run.started_at is not None))  # a retry counts anew


def _delete_run_rows(session: Session, run: Run) -> None:
    """The run's rows; the caller holds the run FOR UPDATE (`lock_run`), so no ingest adds points after the
    metric delete below (metric points have no foreign key to cascade from the run's own delete)."""
    # Metric rows are deleted by statement, never loaded: a long run holds millions.
    session.execute(delete(MetricRollup).where(MetricRollup.run_id == run.id))
    session.execute(delete(MetricPoint).where(MetricPoint.run_id == run.id))
    session.delete(run)  # artifacts, evaluations and their results go by the foreign keys' ON DELETE CASCADE


def _refuse_live(session: Session, runs: list[Run], what: str) -> None:
    """Conflict while a worker may still write to one of `runs`: a queued or running run, or an evaluation of one."""
    live = [r for r in runs if r.status in LIVE and not r.external]
    if live:
        ids = ", ".join(str(r.id) for r in live)
        raise Conflict(f"{what} has runs still queued or running ({ids}); cancel them first (POST "
                       "/api/v1/runs/<id>/cancel) and delete once they have stopped")
    evals = session.scalars(select(Evaluation.id).where(Evaluation.run_id.in_([r.id for r in runs]),
                                                        Evaluation.status.in_(LIVE))).all()
    if evals:
        raise Conflict(f"{what} has evaluations still queued or running ({', '.join(map(str, evals))}); delete "
                       "once they have ended (a queued one whose worker died before it started waits for Redis to "
                       "send its message again; to end it now: POST /api/v1/evaluations/<id>/status "
                       "{\"status\": \"failed\"}, and its message, when it comes back, is skipped)")


def delete_run(session: Session, run_id: int, home: Path) -> None:
    """The run, its metrics, artifacts and evaluations, then its folder (after the rows, which can roll back)."""
    run = lock_run(session, run_id, delete=True)  # an ingest in flight finishes first; later ones get 404
    _refuse_live(session, [run], f"run {run_id}")
    owner = _folder_owner(run)
    _delete_run_rows(session, run)
    session.flush()
    plab_run_folder.remove(home, *owner)


def delete_experiment(session: Session, experiment_id: int, home: Path) -> None:
    exp = get_experiment(session, experiment_id)
    for run_id in sorted(r.id for r in exp.runs):  # locked in id order, as every deletion locks them
        lock_run(session, run_id, delete=True)
    _refuse_live(session, list(exp.runs), f"experiment {experiment_id}")
    owners = [_folder_owner(r) for r in sorted(exp.runs, key=lambda r: r.id)]
    # One flush for every run and the experiment: an autoflush between runs deleted a run that the experiment's
    # cascade then deleted again (SQLAlchemy warned: "expected to delete 2 row(s); 1 were matched").
    with session.no_autoflush:
        for run in list(exp.runs):
            _delete_run_rows(session, run)
        session.delete(exp)
    session.flush()
    for owner in owners:
        plab_run_folder.remove(home, *owner)

