"""Every recipe of an experiment against its baseline run (`Experiment.baseline`, BF16): relative loss difference
over training and a summary.

The relative difference of run R to the baseline B at a baseline point (x_i, b_i) is
`100 * (r(x_i) - b_i) / b_i` percent, where r(x_i) is R's loss linearly interpolated at x_i (tokens by default):
the curves are aligned on the baseline's points (a recipe is judged where the baseline was measured), and only
where R has points on both sides of x_i (no extrapolation). Runs logged on different token grids are therefore
compared at equal tokens.

Long series are compared through the rollup's bucket means (mean loss at mean tokens of each bucket) rather than
raw points: reading every raw row of every run costs seconds on long runs, and a bucket mean is a smoothed loss,
which is what a relative difference of two noisy curves wants. Every run of the comparison is bucketed the same
way - buckets of one width in steps, the finest that gives every run at most max_points of them - because a bucket
mean of a convex loss curve sits above the curve: a live run compared point by point against a finished baseline's
16-step means was 0.95% "better" at step 8 with identical curves. When every run has at most max_points points,
they are compared point by point.
"""
from __future__ import annotations

import math
import statistics

import numpy as np
from sqlalchemy import text
from sqlalchemy.orm import Session

from backend.errors import Conflict, InvalidInput
from backend.models import Run
from backend.services import metrics, rollup
from backend.services.runs import get_experiment

COMPARISON_X = ("tokens", "step")
LIVE = ("queued", "running")


def is_baseline(run: Run, baseline: str) -> bool:
    """The baseline's recipe with no layer kept apart (an ablation of it is a recipe like any)."""
    return run.recipe == baseline and not run.bf16_first_layers and not run.bf16_last_layers


def baseline_replicates(runs: list[Run], baseline: str) -> list[Run]:
    """The runs the verdict and the charts measure against: the experiment's own runs of the baseline (its seed
    replicates). A record-only (external) run of the baseline recipe was trained by someone's own script, with
    data order, initialisation and seed we cannot vouch for: it is a baseline only in an experiment that has no
    run of its own of the baseline (one recorded entirely from scripts); otherwise it is compared like a recipe."""
    candidates = [r for r in runs if is_baseline(r, baseline)]
    return [r for r in candidates if not r.external] or candidates


def baseline_run(runs: list[Run], baseline: str) -> Run | None:
    """The experiment's baseline run, the reference: among `baseline_replicates` (no layer kept apart, the
    experiment's own runs before record-only ones), a succeeded one is preferred, then the earliest."""
    candidates = baseline_replicates(runs, baseline)
    if not candidates:
        candidates = [r for r in runs if r.recipe == baseline]
    if not candidates:
        return None
    succeeded = [r for r in candidates if r.status == "succeeded"]
    return min(succeeded or candidates, key=lambda r: r.id)


def common_shift(extents: list[tuple[int, int, int] | None], max_points: int) -> int:
    """The bucket width (a shift: 2**shift steps) every run of a comparison is read at: 0 (its raw points) when no
    run has more than max_points points, else the finest width that gives each run at most max_points buckets."""
    return max((rollup.shift_for(first, last, max_points) for first, last, total in filter(None, extents)
                if total > max_points), default=0)


def comparison_points(session: Session, run_id: int, key: str, x: str, max_points: int,
                      shift: int | None = None, ext: tuple | None = None) -> tuple[list, list]:
    """(x, loss) of a run's series for comparison, in increasing x: its points (shift 0) or its bucket means of
    2**shift steps from the rollup; `shift` None: the run's own (`common_shift` of it alone). `ext`: the series'
    extent when the caller has read it. Points without a finite value, or without tokens when x is tokens, are
    left out."""
    ext = ext or metrics.series_extent(session, run_id, key)
    if ext is None:
        return [], []
    first, last, total = ext
    if shift is None:
        shift = common_shift([ext], max_points)
    if shift == 0:
        rows = session.execute(text(
            f"SELECT {x}, value FROM metric_points WHERE run_id = :r AND key = :k AND value IS NOT NULL "
            f"AND {x} IS NOT NULL ORDER BY step"), {"r": run_id, "k": key}).all()
        xs, ys = [float(r[0]) for r in rows], [float(r[1]) for r in rows]
    else:
        buckets = metrics.read_buckets(session, run_id, key, first, last, shift)
        xs, ys = [], []
        for b in sorted(buckets):
            a = buckets[b]
            n_x = a.n_tokens if x == "tokens" else a.n_value
            if a.n_value and n_x:
                xs.append((a.sum_tokens if x == "tokens" else a.sum_step) / n_x)
                ys.append(a.sum_value / a.n_value)
    # Interpolation needs strictly increasing x: a resumed run can repeat a token count; keep the first.
    out_x, out_y = [], []
    for xv, yv in zip(xs, ys):
        if not out_x or xv > out_x[-1]:
            out_x.append(xv)
            out_y.append(yv)
    return out_x, out_y


def relative_difference(base_x: list[float], base_y: list[float], x: list[float],
                        y: list[float]) -> tuple[list[float], list[float]]:
    """100 * (y(x_i) - b_i) / b_i at the baseline's points x_i inside the other run's x range (y interpolated
    linearly); baseline points with a zero loss are skipped (no relative difference exists there)."""
    if len(base_x) != len(base_y) or len(x) != len(y):
        raise InvalidInput("each series needs as many x as y values")
    if not base_x or not x:
        return [], []
    bx, by = np.asarray(base_x, dtype=float), np.asarray(base_y, dtype=float)
    rx, ry = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    inside = (bx >= rx[0]) & (bx <= rx[-1]) & (by != 0)
    bx, by = bx[inside], by[inside]
    with np.errstate(over="ignore", invalid="ignore"):
        delta = 100.0 * (np.interp(bx, rx, ry) - by) / by
    finite = np.isfinite(delta)  # a ratio of extreme values (1e300 against 1e-300) has no number: left out
    return bx[finite].tolist(), delta[finite].tolist()


def final_value(session: Session, run_id: int, key: str, last_n: int) -> float | None:
    """Mean of the last last_n finite values of a series (one noisy last step is not a final loss)."""
    rows = session.execute(text(
        "SELECT value FROM metric_points WHERE run_id = :r AND key = :k AND value IS NOT NULL "
        "ORDER BY step DESC LIMIT :n"), {"r": run_id, "k": key, "n": last_n}).all()
    if not rows:
        return None
    try:
        mean = statistics.fmean(r[0] for r in rows)
    except OverflowError:  # values near the float range (stored before ingest capped them at 1e300)
        return None
    return mean if math.isfinite(mean) else None


def throughput(session: Session, run: Run) -> float | None:
    tps = (run.summary or {}).get("tokens_per_s")
    if isinstance(tps, (int, float)) and math.isfinite(tps) and tps > 0:
        return float(tps)
    # A running run has no summary yet: the median of what it logged so far.
    rows = session.execute(text(
        "SELECT value FROM metric_points WHERE run_id = :r AND key = 'perf/tokens_per_s' AND value IS NOT NULL"),
        {"r": run.id}).all()
    return statistics.median(r[0] for r in rows) if rows else None


def _peak_memory(session: Session, run: Run) -> float | None:
    mem = (run.summary or {}).get("peak_mem_gib")
    if isinstance(mem, (int, float)) and math.isfinite(mem):
        return float(mem)
    row = session.execute(text(
        "SELECT MAX(max_value) FROM metric_rollups WHERE run_id = :r AND key = 'perf/peak_mem_gib' AND level = :lv"),
        {"r": run.id, "lv": rollup.MAX_LEVEL}).one()
    return None if row[0] is None else float(row[0])


def run_speedups(runs: list[Run], baseline: str, tps_of: dict[int, float | None]) -> dict:
    """run id -> (speedup, why none) by the verdict's one rule (training.evaluation.verdict.speedups): tokens/s
    over the mean of the baseline replicates' on the same device."""
    from training.evaluation.verdict import RunFacts, speedups

    replicates = {r.id for r in baseline_replicates(runs, baseline)}
    return speedups([RunFacts(run_id=r.id, variant=r.label, recipe=r.recipe, status=r.status, seed=r.seed or 0,
                              is_baseline=r.id in replicates, tokens_per_s=tps_of[r.id], device=r.device_name)
                     for r in runs])


def _finite(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def compare_experiment(session: Session, experiment_id: int, *, key: str = "train/loss", x: str = "tokens",
                       max_points: int = 2000, final_n: int = 20) -> dict:
    """The relative difference of `key` of every non-baseline run to the baseline run, and a per-run summary.

    Raises NotFound for an unknown experiment, Conflict (409) when the experiment has no BF16 run, InvalidInput
    for bad parameters. An unknown key gives empty curves, not an error.
    """
    if x not in COMPARISON_X:
        raise InvalidInput(f"x must be one of {', '.join(COMPARISON_X)} for a comparison (runs at different "
                           f"speeds are not comparable at equal wall time), got {x!r}")
    if not isinstance(max_points, int) or not 2 <= max_points <= 100_000:
        raise InvalidInput(f"max_points must be an integer between 2 and 100000, got {max_points!r}")
    if not isinstance(final_n, int) or not 1 <= final_n <= 10_000:
        raise InvalidInput(f"final_n must be an integer between 1 and 10000, got {final_n!r}")
    exp = get_experiment(session, experiment_id)
    base = baseline_run(list(exp.runs), exp.baseline)
    if base is None:
        raise Conflict(f"experiment {experiment_id} has no {exp.baseline} run yet, and the relative difference is "
                       f"measured against it: add a {exp.baseline} run to the experiment (or submit experiments "
                       f"with {exp.baseline!r} among their recipes)")
    extents = {run.id: metrics.series_extent(session, run.id, key) for run in exp.runs}
    shift = common_shift(list(extents.values()), max_points)
    bx, by = comparison_points(session, base.id, key, x, max_points, shift, extents[base.id])
    base_final = final_value(session, base.id, key, final_n)
    tps_of = {run.id: throughput(session, run) for run in exp.runs}
    speed = run_speedups(list(exp.runs), exp.baseline, tps_of)
    runs_out = []
    for run in exp.runs:
        is_base = run.id == base.id
        final = final_value(session, run.id, key, final_n)
        tps = tps_of[run.id]
        summary = run.summary or {}
        entry = {
            "run_id": run.id, "recipe": run.recipe, "label": run.label, "status": run.status,
            "is_baseline": is_base, "gemm_backend": run.gemm_backend, "emulated": run.gemm_backend == "emulated",
            "final_loss": final,
            # Final against final only when both have ended: a run still training is at another point of its curve
            # (the curves above compare it at equal tokens).
            "final_delta_pct": _finite(100.0 * (final - base_final) / base_final
                                       if final is not None and base_final not in (None, 0)
                                       and run.status not in LIVE and base.status not in LIVE else None),
            "tokens_per_s": tps, "speedup": speed[run.id][0], "speedup_note": speed[run.id][1],
            "device_name": run.device_name, "mfu": _finite(summary.get("mfu")), "peak_mem_gib": _peak_memory(session, run),
        }
        if is_base:
            entry["x"], entry["delta_pct"] = [], []
        else:
            rx, ry = comparison_points(session, run.id, key, x, max_points, shift, extents[run.id])
            entry["x"], entry["delta_pct"] = relative_difference(bx, by, rx, ry)
        runs_out.append(entry)
    note = None
    if not bx:
        note = (f"the {exp.baseline} run has no {key!r} points with {x} yet: no difference to show" if x == "tokens"
                else f"the {exp.baseline} run has no {key!r} points yet: no difference to show")
    return {"experiment_id": exp.id, "key": key, "x": x, "baseline_run_id": base.id, "final_n": final_n,
            "aligned_on": f"the baseline's points ({x}); other runs interpolated linearly", "note": note,
            "runs": runs_out}
