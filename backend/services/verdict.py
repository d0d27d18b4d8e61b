"""An experiment's verdict from the database: the facts of every run (final and lowest validation loss,
throughput, GEMM backend, paired accuracy rows), handed to the one verdict rule of
training.evaluation.verdict. The API, the experiments list, the experiment page and `plab demo` all read it here."""
from __future__ import annotations

import json
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
    """The run's label without the ` seed=N` a seed replicate carries: the name its variant is shown by."""
    return re.sub(rf" seed={run.seed}$", "", run.label) if run.seed is not None else run.label


def variant_key(run: Run) -> str:
    """What makes runs seed replicates of one recipe variant: recipe, options and kept layers (not the label, which
    anyone may edit: a renamed run must not merge into another variant). A record-only run is a variant of its
    own (its script's seed and settings are unknown)."""
    if run.external:
        return f"external:{run.id}"
    return json.dumps([run.recipe, run.recipe_options or {}, run.bf16_first_layers or 0, run.bf16_last_layers or 0],
                      sort_keys=True)


def variant_names(runs: list[Run]) -> dict[int, str]:
    """run id -> its variant's name: the first replicate's label without its seed, made unique (a second variant
    whose label reads the same gets ` (run N)`)."""
    first: dict[str, Run] = {}
    for run in sorted(runs, key=lambda r: r.id):
        first.setdefault(variant_key(run), run)
    names: dict[str, str] = {}
    taken: set[str] = set()
    for key, run in first.items():
        name = variant_of(run)
        if name in taken:
            name = f"{name} (run {run.id})"
        taken.add(name)
        names[key] = name
    return {run.id: names[variant_key(run)] for run in runs}


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
    replicates = {r.id for r in comparison.baseline_replicates(runs, exp.baseline)}
    names = variant_names(runs)
    accuracy, accuracy_error = _accuracy_rows(session, experiment_id)
    facts = []
    for run in runs:
        final, lowest = _val_losses(session, run.id)
        facts.append(RunFacts(
            run_id=run.id, variant=names[run.id], recipe=run.recipe, status=run.status,
            seed=run.seed if run.seed is not None else exp.seed, is_baseline=run.id in replicates,
            final_val_loss=final, min_val_loss=lowest, tokens_per_s=comparison.throughput(session, run),
            emulated=run.gemm_backend == "emulated", accuracy=tuple(accuracy.get(run.id, ())),
            device=run.device_name))
    out = judge(facts, reference_run_id=reference.id if reference else None,
                tolerance_pct=exp.verdict_tolerance_pct)
    validation = _validation(reference)
    if validation is not None and any(e.get("outcome") for e in out["recipes"]):
        out["summary"] += _validation_clause(validation, runs, reference, names)
    if reference is not None and any(e.get("outcome") for e in out["recipes"]):
        out["summary"] += _data_clause(runs, reference, names)
    return {"experiment_id": exp.id, "baseline_recipe": exp.baseline, "metric": VAL_KEY,
            "accuracy_error": accuracy_error, "validation": validation, **out}


def _token_cache(run: Run) -> str | None:
    cache = ((run.summary or {}).get("data") or {}).get("cache")
    return cache if isinstance(cache, str) and cache else None


def _data_clause(runs: list[Run], reference: Run, names: dict[int, str]) -> str:
    """Which runs, if any, trained on other tokens than the reference: an experiment's runs read the corpus when
    each one starts, so a file added to data.corpus between them gives a later run another tokenizer and token
    order (a review: a recipe "beat" BF16 on a third more text). Their runs' `data.cache` differ."""
    from training.shards import same_token_data

    ref = _token_cache(reference)
    if ref is None:
        return ""
    others = [names[r.id] for r in runs if r.id != reference.id and (c := _token_cache(r)) is not None
              and not same_token_data(c, ref)]
    if not others:
        return ""
    return (f"; {', '.join(sorted(set(others)))} trained on other data than the reference (another token cache: "
            f"the corpus or the tokenizer changed between the runs): not like for like")


def _validation(run: Run | None) -> dict | None:
    """What a run's val loss is the mean over (its summary's `validation`: windows, tokens, rule), if it says."""
    v = ((run.summary or {}).get("validation") if run is not None else None)
    if not isinstance(v, dict) or not isinstance(v.get("tokens"), int) or not isinstance(v.get("windows"), int):
        return None
    return {k: v.get(k) for k in ("windows", "tokens", "rule", "split_windows", "split_tokens")}


def _validation_clause(validation: dict, runs: list[Run], reference: Run, names: dict[int, str]) -> str:
    """The verdict's last words: how much held-out text its val losses are measured on - a +1% on 4,096 tokens is not
    one on 4 million - and which runs, if any, were measured on other windows than the reference."""
    where = "spread over the split" if validation.get("rule") == "spread" else "in a row at the split's start"
    clause = f"; val loss over {validation['tokens']:,} held-out tokens ({validation['windows']} windows {where})"
    measured = {r.id: _validation(r) for r in runs if r.id != reference.id}
    others = [names[i] for i, v in measured.items()
              if v is not None and (v["tokens"], v["rule"]) != (validation["tokens"], validation["rule"])]
    if others:
        clause += (f"; {', '.join(sorted(set(others)))} validated on other windows than the reference: "
                   "not like for like")
    return clause
