"""An experiment's verdict from the database: the facts of every run (final and lowest validation loss,
throughput, GEMM backend, paired accuracy rows), handed to the one verdict rule of
training.evaluation.verdict. The API, the experiments list, the experiment page and `plab demo` all read it here."""
from __future__ import annotations

import re

from sqlalchemy import text
from sqlalchemy.orm import Session

from backend.errors import Conflict
from backend.models import Run
from backend.services import comparison, evaluations
from backend.services.runs import get_experiment

VAL_KEY = "val/loss"


def _val_losses(session: Session, run_id: int) -> tuple[float | None, float | None]:
    """(final, lowest) validation loss of a run: its last finite val/loss point and the minimum over the run."""
    final = comparison.final_value(session, run_id, VAL_KEY, 1)
    lowest = session.execute(text("SELECT MIN(value) FROM metric_points WHERE run_id = :r AND key = :k"),
                             {"r": run_id, "k": VAL_KEY}).scalar()
    return final, None if lowest is None else float(lowest)


def variant_of(run: Run) -> str:
    """The run's recipe variant: its label without the ` seed=N` a seed replicate carries."""
    return re.sub(rf" seed={run.seed}$", "", run.label) if run.seed is not None else run.label


def is_baseline(run: Run, baseline: str) -> bool:
    """A replicate of the baseline: its recipe, with no layer kept apart (an ablation of it is a recipe like any)."""
    return run.recipe == baseline and not run.bf16_first_layers and not run.bf16_last_layers


def _accuracy_rows(session: Session, experiment_id: int) -> tuple[dict[int, list], str | None]:
    """run id -> its paired rows against the baseline; with the reason instead when pairing was refused."""
    try:
        table = evaluations.accuracy_table(session, experiment_id)
    except Conflict as e:
        return {}, str(e)
    return {r["run_id"]: r["vs_bf16"] for r in table["runs"]}, None


def experiment_verdict(session: Session, experiment_id: int) -> dict:
    """The verdict of training.evaluation.verdict.experiment_verdict for the experiment, plus the run ids it names.
    NotFound for an unknown experiment; an experiment without a baseline run gets a verdict that says so."""
    from training.evaluation.verdict import RunFacts
    from training.evaluation.verdict import experiment_verdict as judge

    exp = get_experiment(session, experiment_id)
    runs = list(exp.runs)
    reference = comparison.baseline_run(runs, exp.baseline)
    accuracy, accuracy_error = _accuracy_rows(session, experiment_id)
    facts = []
    for run in runs:
        final, lowest = _val_losses(session, run.id)
        facts.append(RunFacts(
            run_id=run.id, variant=variant_of(run), recipe=run.recipe, status=run.status,
            seed=run.seed if run.seed is not None else exp.seed, is_baseline=is_baseline(run, exp.baseline),
            final_val_loss=final, min_val_loss=lowest, tokens_per_s=comparison.throughput(session, run),
            emulated=run.gemm_backend == "emulated", accuracy=tuple(accuracy.get(run.id, ()))))
    out = judge(facts, reference_run_id=reference.id if reference else None,
                tolerance_pct=exp.verdict_tolerance_pct)
    return {"experiment_id": exp.id, "baseline_recipe": exp.baseline, "metric": VAL_KEY,
            "accuracy_error": accuracy_error, **out}
