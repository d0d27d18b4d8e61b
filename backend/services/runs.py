"""Experiments and runs: creation (one run per recipe), the status machine, cancellation, a run's metrics."""
from __future__ import annotations

import re
from datetime import timezone

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from backend.errors import Conflict, InvalidInput, NotFound
from backend.models import BASELINE_RECIPE, FINAL_STATUSES, Artifact, Experiment, MetricPoint, Run, utcnow
from backend.schemas import (MAX_RECIPE_LABEL, MAX_RUNS_PER_EXPERIMENT, ArtifactIn, ExperimentCreate, MetricBatchResult,
                             RecipeRequest, RunCreate, RunInfoUpdate, Series, SeriesQuery, StatusUpdate)
from backend.services import leases, metrics

# Which status a run may move to from which: a worker retried after a crash re-announces `running`.
TRANSITIONS = {
    "queued": {"running", "cancelled", "failed"},
    "running": {"running", "succeeded", "failed", "cancelled", "diverged"},
}


def run_label(recipe: RecipeRequest) -> str:
    if recipe.label:
        return recipe.label
    parts = [recipe.name]
    if recipe.bf16_first_layers:
        parts.append(f"bf16_first={recipe.bf16_first_layers}")
    if recipe.bf16_last_layers:
        parts.append(f"bf16_last={recipe.bf16_last_layers}")
    if recipe.keep_bf16:
        parts.append(f"keep_bf16={','.join(recipe.keep_bf16)}")
    parts += [f"{k}={v}" for k, v in sorted(recipe.options.items())]
    label = " ".join(parts)
    # Made from the settings, it can be long (many keep_bf16 patterns): cut to fit the column with what is added.
    return label if len(label) <= MAX_RECIPE_LABEL else label[:MAX_RECIPE_LABEL - 1] + "…"


def build_spec(body: ExperimentCreate, recipe: RecipeRequest, seed: int | None = None, *,
               check_files: bool = True) -> dict:
    """The run spec of docs/INTERFACES.md, validated by the training library itself; `check_files=False` skips
    looking at the files it names (the experiment's other recipes share its model and data)."""
    spec = {"model": body.model, "data": body.data, "training": body.training,
            "seed": body.seed if seed is None else seed,
            "recipe": recipe.name, "recipe_options": recipe.options,
            "bf16_first_layers": recipe.bf16_first_layers, "bf16_last_layers": recipe.bf16_last_layers,
            "keep_bf16": list(recipe.keep_bf16)}
    from training.config import RunSpec, SpecError, check_new_run_data, confine_spec_paths

    try:
        run_spec = RunSpec.from_dict(spec, check_paths=False)
        parsed = run_spec.to_dict()
        roots = spec_roots()
        confine_spec_paths(parsed, roots)
        preset = run_spec.model.source == "preset"
        # A model from a file is looked at for each recipe: their BF16 layer choices differ.
        here = (check_files or not preset) and _paths_are_here(parsed, roots)
        checked = RunSpec.from_dict(spec, check_paths=True) if here else run_spec
        if check_files and here:
            check_new_run_data(checked.data)
        if (preset and run_spec.keep_bf16) or (not preset and here):
            # The layer choices against the model's blocks, on the model built on the meta device, and a file
            # model's config.json read as the worker will read it (this imports torch and transformers; a preset
            # without keep_bf16 rules, whose block count the spec's own checks know, imports nothing)
            from training.setup import check_layer_choices

            check_layer_choices(checked)
        return parsed
    except SpecError as e:
        raise InvalidInput(f"the run spec of recipe {recipe.name}: {e}") from e


def _paths_are_here(spec: dict, roots: list) -> bool:
    """Whether this host holds the folders the spec's paths lie in: the data directory and, for a path elsewhere,
    its PLAB_ALLOWED_PATHS folder. Then the corpus, tokenizer and model paths are checked when the experiment is
    submitted (a typo in data.corpus is a 422, not a failed run per recipe); the embedded default and the compose
    file's API (which mounts the workers' data read-only) hold them. An API without the data checks nothing."""
    from training.config import SpecError, confine_spec_paths

    present = [r for r in roots if r.is_dir()]
    if not present or present[0] != roots[0]:
        return False
    try:
        confine_spec_paths(spec, present)
    except SpecError:
        return False
    return True


def spec_roots() -> list:
    """Where the paths of a spec that arrives through the API may point: the data directory and PLAB_ALLOWED_PATHS
    (the OpenAPI document's path patterns say the same, backend/spec_schema.py)."""
    from plab.settings import get_settings

    settings = get_settings()
    return [p.resolve() for p in (settings.data_dir, *settings.allowed_paths)]


def check_eval_tasks(names: list[str], field: str = "eval_tasks") -> None:
    """An experiment's `eval_tasks` (an evaluation's `tasks`: `field`) must be tasks lm-eval can find (shipped,
    PLAB_EVAL_TASKS_DIR, lm-eval's own): a typo is refused now, not after training or in a worker's job."""
    if not names:
        return
    import difflib

    from training.evaluation.taskdirs import known_task_names

    known = known_task_names()
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise InvalidInput(f"{field}: unknown task {name!r}{hint} (plab eval --list-tasks lists them; your own "
                               "YAML tasks need PLAB_EVAL_TASKS_DIR)")


def create_experiment(session: Session, body: ExperimentCreate) -> Experiment:
    check_eval_tasks(body.eval_tasks)
    recipes = list(body.recipes)
    if not any(r.name == BASELINE_RECIPE for r in recipes):
        # The baseline is what every comparison is made against: always run it.
        recipes.insert(0, RecipeRequest(name=BASELINE_RECIPE))
    recipes, labels = _distinct_recipes(recipes)
    recipes = [_with_seeds(body, r) for r in recipes]
    n_runs = sum(len(r.seeds or [body.seed]) for r in recipes)
    if n_runs > MAX_RUNS_PER_EXPERIMENT:
        raise InvalidInput(f"{n_runs} runs (recipes x seeds) is more than {MAX_RUNS_PER_EXPERIMENT} in one "
                           "experiment; use fewer seeds or replicate only the baseline (replicate='baseline')")
    specs = [build_spec(body, r, check_files=i == 0) for i, r in enumerate(recipes)]
    training_config = {**body.training, Experiment.VERDICT_KEY: {"tolerance_pct": body.verdict_tolerance_pct}}
    exp = Experiment(name=body.name, description=body.description, model_config_=body.model, data_config=body.data,
                     training_config=training_config, seed=body.seed,
                     recipes=[r.model_dump() for r in recipes], baseline=BASELINE_RECIPE, eval_tasks=body.eval_tasks)
    for r, label, spec in zip(recipes, labels, specs):
        # Seed replicates of a recipe: the same validated spec, only the seed differs.
        for seed in r.seeds or [body.seed]:
            exp.runs.append(Run(recipe=r.name, recipe_options=r.options, bf16_first_layers=r.bf16_first_layers,
                                bf16_last_layers=r.bf16_last_layers, label=f"{label} seed={seed}" if r.seeds else label,
                                spec={**spec, "seed": seed}, status="queued"))
    session.add(exp)
    session.flush()
    return exp


def _distinct_recipes(recipes: list[RecipeRequest]) -> tuple[list[RecipeRequest], list[str]]:
    """A recipe given twice with the same settings is one recipe (like a task named twice); recipes with different
    settings whose labels coincide (an explicit label equal to another's) get " #2", " #3", ... so that every
    variant keeps a name of its own (the verdict and the comparisons tell variants apart by label)."""
    import json

    seen, out = set(), []
    for r in recipes:
        key = json.dumps(r.model_dump(), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(r)
    labels: list[str] = []
    for i, r in enumerate(out):
        base = run_label(r)
        label, n = base, 2
        while label in labels:
            suffix = f" #{n}"
            label, n = base[:MAX_RECIPE_LABEL - len(suffix)] + suffix, n + 1
        if label != base:
            out[i] = r.model_copy(update={"label": label})
        labels.append(label)
    return out, labels


def _with_seeds(body: ExperimentCreate, recipe: RecipeRequest) -> RecipeRequest:
    """The recipe with the seeds it trains with: its own, else the experiment's `seeds` where they apply."""
    if recipe.seeds is not None or body.seeds is None:
        return recipe
    baseline = recipe.name == BASELINE_RECIPE and not recipe.bf16_first_layers and not recipe.bf16_last_layers
    if body.replicate == "all" or baseline:
        return recipe.model_copy(update={"seeds": list(body.seeds)})
    return recipe


def create_external_run(session: Session, body: RunCreate) -> Run:
    exp = get_experiment(session, body.experiment_id)
    spec = {"external": True, "recipe": body.recipe, "recipe_options": body.recipe_options}
    run = Run(experiment_id=exp.id, recipe=body.recipe, recipe_options=body.recipe_options,
              label=body.label or f"{body.recipe} (external)", spec=spec, external=True, status="running",
              started_at=utcnow())
    session.add(run)
    session.flush()
    return run


def get_experiment(session: Session, experiment_id: int) -> Experiment:
    exp = session.get(Experiment, experiment_id, options=[selectinload(Experiment.runs)])
    if exp is None:
        raise NotFound(f"experiment {experiment_id} does not exist")
    return exp


def get_run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} does not exist")
    return run


def lock_run(session: Session, run_id: int, *, delete: bool = False) -> Run:
    """The run, its row locked until the transaction ends: FOR NO KEY UPDATE to write its metrics (a deletion, and
    the next writer of the same run, wait for the writer), FOR UPDATE to delete it (a writer of its metrics waits
    for the deletion, then finds the run gone: 404). Metric rows have no foreign key to the run (migration 0007);
    these locks are what keeps a point from being stored for a deleted run. On SQLite the database's write lock,
    taken here, does the same.

    Not FOR KEY SHARE, as it was until 2026-11-27: every batch with a `train/loss` point also updates the row
    (progress), and a shared lock taken while another writer's update of the row was in flight did not always
    hold off the deletion on PostgreSQL 15: in about 1 of 90 runs of
    tests/backend/test_metric_integrity.py::test_many_writers_racing_a_deletion_leave_no_orphan under load, a
    writer's insert met a run deleted after its lock (the rollup's foreign key refused it; the points themselves,
    which have none, would have been orphans) or a writer deadlocked in that key's check. An exclusive row lock
    leaves one row version per writer and no shared locker to carry across versions; writers of one run queue
    (each one's transaction is a few statements), and a waiting deletion is no longer overtaken by new writers."""
    if session.get_bind().dialect.name == "sqlite":
        metrics.begin_write(session)
    run = session.scalars(select(Run).where(Run.id == run_id)
                          .with_for_update(key_share=not delete)  # FOR NO KEY UPDATE / FOR UPDATE
                          .execution_options(populate_existing=True)).first()
    if run is None:
        raise NotFound(f"run {run_id} does not exist")
    return run


def cancel_run(session: Session, run_id: int) -> Run:
    run = get_run(session, run_id)
    if run.status in FINAL_STATUSES:
        raise Conflict(f"run {run_id} already ended with status '{run.status}'; nothing to cancel")
    run.cancel_requested = True
    if run.status == "queued":
        # Not started: no worker will train it (the worker checks the status before it starts).
        run.status = "cancelled"
        run.finished_at = utcnow()
    return run


def reopen(session: Session, run_id: int) -> Run:
    """A failed or cancelled run of ours put back to `queued` for POST /runs/{id}/retry (its job is then sent by
    `dispatch.retry_run`): the worker resumes it from the last checkpoint in its run folder, and it may be started
    PLAB_MAX_ATTEMPTS times again. Its previous error is cleared; its metrics, artifacts and started_at stay."""
    run = session.get(Run, run_id, with_for_update=True)
    if run is None:
        raise NotFound(f"run {run_id} does not exist")
    if run.external:
        raise Conflict(f"run {run_id} is a record-only run: the user's own script trains it and reports it through "
                       "the API; run that script again")
    if run.status == "diverged":
        raise Conflict(f"run {run_id} diverged (at step {run.diverged_step}): training is deterministic, so the "
                       "same spec diverges again; submit a new experiment with a lower training.lr, a longer "
                       "warm-up or another recipe")
    if run.status not in ("failed", "cancelled"):
        later = " (its cancel was requested: retry it once it is cancelled)" if run.cancel_requested else ""
        raise Conflict(f"run {run_id} is '{run.status}': only a failed or cancelled run can be retried{later}")
    run.status, run.cancel_requested, run.finished_at = "queued", False, None
    run.error_message, run.heartbeat_at, run.worker_host, run.attempts = None, None, None, 0
    # No dispatch until the new message is sent: the reconciler must not take the old one for lost meanwhile, and
    # a job of the old dispatch (a Slurm supervisor, a worker draining) sees the run was sent again.
    run.dispatch_id, run.dispatched_at = None, None
    # The next attempt's job says where it resumed and which Slurm job it runs as.
    run.summary = {k: v for k, v in (run.summary or {}).items() if k not in ("resumed_from_step", "slurm")}
    return run


def _slurm_job(holder: str | None) -> str | None:
    """The Slurm job id of a worker_host written by a job in Slurm ("slurm job 123 (node1)")."""
    if holder and holder.startswith("slurm job "):
        return holder.split()[2]
    return None


def _claim(run: Run, stale_s: float, claimant: str | None = None) -> None:
    """A job starts a run by reporting `running`: refused while another job holds the run (`leases`), so a
    duplicate or late-delivered message never trains a run twice at once. A record-only (external) run is reported
    by its owner's own process, which may repeat `running`; so may the same Slurm job restarted after a requeue
    (Slurm runs one incarnation of a job at a time)."""
    same_slurm_job = _slurm_job(claimant) is not None and _slurm_job(claimant) == _slurm_job(run.worker_host)
    age = None if run.external or same_slurm_job else leases.held_by_another(run, stale_s, claimant)
    if age is not None:
        raise Conflict(f"run {run.id} is being trained by another job (last heartbeat {age:.0f} s ago)")


def _aware(t):
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def heartbeat(session: Session, run_id: int, holder: str | None = None) -> Run:
    """A running job's lease renewed (`leases.renew`: a job naming itself renews only its own); the answer tells
    it whether to stop."""
    return leases.renew(session, Run, run_id, "run", holder)


def update_status(session: Session, run_id: int, body: StatusUpdate, stale_s: float = 60.0) -> Run:
    run = session.get(Run, run_id, with_for_update=body.status == "running")
    if run is None:
        raise NotFound(f"run {run_id} does not exist")
    allowed = TRANSITIONS.get(run.status, set())
    if body.status not in allowed:
        raise Conflict(f"run {run_id} cannot go from '{run.status}' to '{body.status}'"
                       + (" (it has already ended)" if run.status in FINAL_STATUSES else ""))
    if body.status == "running":
        _claim(run, stale_s, body.worker_host)
        if run.status == "queued" or run.started_at is None:
            run.started_at = utcnow()
        run.attempts = (run.attempts or 0) + 1
        run.heartbeat_at = utcnow()
    if body.status in FINAL_STATUSES:
        run.finished_at = utcnow()
    run.status = body.status
    for field in ("worker_host", "device_name", "error_message", "diverged_step", "gemm_backend"):
        value = getattr(body, field)
        if value is not None:
            setattr(run, field, value)
    if body.summary is not None:
        run.summary = {**(run.summary or {}), **body.summary}
    if body.progress is not None:
        run.progress = body.progress.model_dump(exclude_none=True)
    if body.conversion_report is not None:
        run.conversion_report = body.conversion_report
    return run


def update_info(session: Session, run_id: int, body: RunInfoUpdate) -> Run:
    """The worker's informational fields; the user's (label, tags, notes, archived) are
    `housekeeping.update_run`'s, which calls this."""
    run = get_run(session, run_id)
    if body.device_name is not None:
        run.device_name = body.device_name
    if body.gemm_backend is not None:
        run.gemm_backend = body.gemm_backend
    if body.summary is not None:
        run.summary = {**(run.summary or {}), **body.summary}
    if body.conversion_report is not None:
        run.conversion_report = body.conversion_report
    return run


def add_artifact(session: Session, run_id: int, body: ArtifactIn) -> Artifact:
    """One record per (run, kind, path): reporting the same artifact again (a final checkpoint announced by the
    training loop and again with the result) updates its step and merges its meta."""
    get_run(session, run_id)
    same = session.scalars(select(Artifact).where(Artifact.run_id == run_id, Artifact.kind == body.kind,
                                                  Artifact.path == body.path)).first()
    if same is not None:
        if body.step is not None:
            same.step = body.step
        same.meta = {**(same.meta or {}), **(body.meta or {})}
        session.flush()
        return same
    art = Artifact(run_id=run_id, **body.model_dump())
    session.add(art)
    session.flush()
    return art


def list_artifacts(session: Session, run_id: int) -> list[Artifact]:
    get_run(session, run_id)
    return list(session.scalars(select(Artifact).where(Artifact.run_id == run_id).order_by(Artifact.id)))


def ingest_metrics(session: Session, run_id: int, series: dict[str, list[tuple]], *,
                   refuse_ended: bool = False) -> MetricBatchResult:
    """A batch of points ({key: [(step, value, tokens, wall_time)]}, idempotent on run, key, step); the highest
    `train/loss` step seen is the run's progress. The answer carries the run's status and `cancel_requested`,
    which is how a worker learns of a cancel.

    `refuse_ended` (what the API's POST /runs/{id}/metrics passes, for every writer from outside): a run that has
    ended (succeeded, failed, cancelled, diverged) takes no new point, its curves being what its verdict was judged
    on. A batch whose points are all stored already (a retry whose first answer was lost, an old job flushing steps
    the run's later job stored too) is still answered with every point a duplicate; a batch with a new point is
    refused whole (Conflict, 409). Without it (in-process writers: a migration's or a test's own history) the status
    is not looked at."""
    run = lock_run(session, run_id)  # held until the commit: the run cannot be deleted under the insert
    if refuse_ended and run.status in FINAL_STATUSES:
        return _ended_run_batch(session, run, series)
    inserted, duplicates = metrics.ingest(session, run_id, series)
    loss_steps = series.get("train/loss")
    if loss_steps:
        total = (run.spec.get("training") or {}).get("steps")
        known = (run.progress or {}).get("step") if isinstance(run.progress, dict) else None
        # A row stored before progress was validated may hold anything: only an integer step counts.
        step = max(max(p[0] for p in loss_steps), known if isinstance(known, int) and not isinstance(known, bool)
                   else -1)
        run.progress = {"step": step, "total": total}
    return MetricBatchResult(inserted=inserted, duplicates=duplicates, run_status=run.status,
                             cancel_requested=run.cancel_requested)


def _ended_run_batch(session: Session, run: Run, series: dict[str, list[tuple]]) -> MetricBatchResult:
    """The answer to a batch for an ended run: 200 (all duplicates) when every point is stored, else Conflict."""
    wanted = {key: {p[0] for p in pts} for key, pts in series.items() if pts}
    new: list[tuple[str, int]] = []
    for key in sorted(wanted):
        steps = wanted[key]
        stored = set(session.scalars(select(MetricPoint.step).where(
            MetricPoint.run_id == run.id, MetricPoint.key == key,
            MetricPoint.step.between(min(steps), max(steps)))))
        new += [(key, step) for step in sorted(steps - stored)]
    received = sum(len(pts) for pts in series.values())
    if new:
        key, step = new[0]
        ended = f" at {_aware(run.finished_at):%Y-%m-%d %H:%M:%S} UTC" if run.finished_at else ""
        raise Conflict(f"run {run.id} has ended (status '{run.status}'{ended}): its metrics can no longer change, "
                       f"and {len(new)} of its {received} points are not stored yet (first: {key} step {step}); send "
                       "metric points before reporting the run's final status (flush or close the metric stream "
                       "first)")
    return MetricBatchResult(inserted=0, duplicates=received, run_status=run.status,
                             cancel_requested=run.cancel_requested)


def metric_keys(session: Session, run_id: int) -> dict:
    get_run(session, run_id)
    return {"run_id": run_id, "keys": metrics.metric_keys(session, run_id)}


def run_series(session: Session, run_id: int, key: str, q: SeriesQuery) -> Series:
    get_run(session, run_id)
    if q.empty:
        return _empty_series(key)
    return metrics.read_series(session, run_id, key, max_points=q.max_points, x=q.x, x_min=q.x_min, x_max=q.x_max)


def _empty_series(key: str) -> Series:
    return Series(key=key, step=[], tokens=[], wall_time=[], value=[], total_points=0, downsampled=False)


def experiment_metric_keys(session: Session, experiment_id: int) -> dict:
    """Every key any run of the experiment logged, with how many runs logged it and their points in all. Read from
    the rollup's coarsest level (one row per series) instead of counting raw rows."""
    from sqlalchemy import text

    from backend.services.rollup import MAX_LEVEL

    exp = get_experiment(session, experiment_id)
    rows = session.execute(text(
        "SELECT r.key, COUNT(DISTINCT r.run_id), SUM(r.n_points) FROM metric_rollups r JOIN runs ON runs.id = r.run_id "
        "WHERE runs.experiment_id = :e AND r.level = :lv GROUP BY r.key ORDER BY r.key"),
        {"e": exp.id, "lv": MAX_LEVEL}).all()
    return {"experiment_id": exp.id, "keys": [{"key": k, "runs": int(n), "points": int(p)} for k, n, p in rows]}


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def run_numerics(session: Session, run_id: int, stat: str, max_points: int) -> dict:
    """Every converted layer's `numerics/<layer>/<stat>` series of a run, in one answer (the heatmap's rows, in
    layer order), each downsampled to `max_points` like any series."""
    get_run(session, run_id)
    suffix = f"/{stat}"
    keys = sorted((k["key"] for k in metrics.metric_keys(session, run_id)
                   if k["key"].startswith("numerics/") and k["key"].endswith(suffix)), key=_natural)
    answers = metrics.read_many(session, [run_id], keys, max_points=max_points)
    layers = [{"layer": k[len("numerics/"):-len(suffix)], "step": answers[(run_id, k)].step,
               "value": answers[(run_id, k)].value} for k in keys]
    return {"run_id": run_id, "stat": stat, "layers": layers}


def experiment_series(session: Session, experiment_id: int, keys: list[str], q: SeriesQuery) -> dict:
    """Every run's series for the given keys (an unknown key is an empty series), downsampled by `read_many`."""
    exp = get_experiment(session, experiment_id)
    if q.empty:
        answers = {(run.id, k): _empty_series(k) for run in exp.runs for k in keys}
    else:
        answers = metrics.read_many(session, [run.id for run in exp.runs], keys, max_points=q.max_points, x=q.x,
                                    x_min=q.x_min, x_max=q.x_max)
    out = []
    for run in exp.runs:
        series = {}
        for k in keys:
            s = answers[(run.id, k)]
            series[k] = {"step": s.step, "tokens": s.tokens, "wall_time": s.wall_time, "value": s.value,
                         "total_points": s.total_points, "downsampled": s.downsampled}
        out.append({"run_id": run.id, "recipe": run.recipe, "label": run.label, "status": run.status,
                    "gemm_backend": run.gemm_backend, "series": series})
    return {"experiment_id": exp.id, "x": q.x, "keys": keys, "runs": out}
