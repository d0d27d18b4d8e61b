"""The verdict of an experiment: for every recipe, does it match BF16 on what matters, and at what speed?

What matters is the *validation* loss (held-out tokens, the same batches for every recipe), not the last noisy
training-loss sample. Per recipe variant (a recipe with its options and kept layers; its seed replicates pooled):

- ``val_delta_pct``: ``100 * (mean final val loss of the variant's finished seeds - reference) / reference``
  (runs still training are shown but not judged), where the reference
  is the final validation loss of the baseline's reference run (its first seed: the run every chart compares with);
  ``min_val_delta_pct`` the same for the lowest validation loss over a run (the variant's finished seeds' lowest,
  averaged, against the reference run's own lowest);
- ``speedup`` (``speedups``): a run's tokens/s over the mean tokens/s of the baseline's replicates that ran on the
  same device (its finished ones; all of them while none has finished), none where no baseline replicate ran on
  that device (a speedup across two kinds of GPU is not the format's); a variant's is the mean of its seeds'
  (a value < 1 is called a slowdown);
- accuracy differences to the baseline where evaluated (paired, Holm-corrected: training.evaluation.stats).

The rule that says "matches BF16":

- ``seed_band`` when the baseline has at least two seed replicates with a validation loss: a 95% band for what a
  recipe that trains like BF16 would show, from BF16's own seed-to-seed spread. With BF16's deltas d_1..d_n to the
  reference (the reference's 0 among them; mean d, standard deviation s) and a recipe pooled over k finished seeds,
  the band is ``d ± t(0.975, df) · s_p · sqrt(1/n + 1/k)``, where s_p = s and df = n - 1 for one recipe seed, and
  with k >= 2 s_p pools BF16's and the recipe's own seeds (df = n + k - 2): a two-sample t interval, so a recipe
  identical to BF16 is called better or worse 5% of the time (for normal seed-to-seed variation; a recipe run
  shares its seed's initial weights and batch order with that BF16 run, which makes their difference vary less,
  so the band errs on the side of "matches"). A recipe matches when its delta lies inside its band, is *better*
  below it and *worse* above it. (The min-max of BF16's seeds, the rule before, calls an identical one-seed recipe
  better or worse with probability 2 / (n + 1): half the time with three BF16 seeds.) The top-level ``band_pct``
  is the band for a one-seed recipe; each recipe's entry carries the band it was judged by;
- ``tolerance`` otherwise: a recipe matches when ``|val_delta_pct| <= tolerance_pct`` (the experiment's stated
  tolerance, 1% unless set), better below ``-tolerance_pct``, worse above ``+tolerance_pct``.

A "matches" by the seed band is ``resolved`` only when the band's half-width is within the stated tolerance (as an
equivalence test claims equivalence only when its interval lies inside the margin): inside a wider band the runs
cannot tell a difference of the size asked about, the summary says so and names no recipe, and the dashboard shows
"inside BF16's noise" instead of "matches BF16".

This module is pure (plain data in, plain data out): the API's verdict service feeds it from the database, and
anything else (a script on exported JSON) can call it the same way.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_TOLERANCE_PCT = 1.0
SEED_BAND_CONFIDENCE = 0.95
RULES = ("seed_band", "tolerance")


@dataclass(frozen=True)
class RunFacts:
    """What the verdict needs of one run. `variant` names the recipe with its options and kept layers, the same for
    every seed replicate of it; `accuracy` holds the run's paired rows against the baseline's reference run
    (training.evaluation.stats.compare_results), empty where it was not evaluated."""
    run_id: int
    variant: str
    recipe: str
    status: str
    seed: int
    is_baseline: bool
    final_val_loss: float | None = None
    min_val_loss: float | None = None
    tokens_per_s: float | None = None
    emulated: bool = False
    accuracy: Sequence[dict] = field(default_factory=tuple)
    device: str | None = None  # the GPU (or CPU) it trained on; None where not known


def _same_device(a: str | None, b: str | None) -> bool:
    """Two runs' devices are comparable unless both are known and differ (an external run may not say)."""
    return not a or not b or a == b


def speedups(runs: Sequence[RunFacts]) -> dict[int, tuple[float | None, str | None]]:
    """run id -> (speedup, why none): the run's tokens/s over the mean tokens/s of the baseline replicates on its
    device (the finished ones; all of them while none has finished). The one definition of a speedup: the
    verdict, the comparison endpoint and the dashboard's throughput chart all show these numbers."""
    base = [r for r in runs if r.is_baseline]
    out: dict[int, tuple[float | None, str | None]] = {}
    for r in runs:
        tps = _finite(r.tokens_per_s)
        if tps is None:
            out[r.run_id] = (None, "no throughput reported yet")
            continue
        here = [b for b in base if _same_device(b.device, r.device)]
        base_tps = _mean(b.tokens_per_s for b in here if b.status == "succeeded") or _mean(
            b.tokens_per_s for b in here)
        if base_tps:
            out[r.run_id] = (tps / base_tps, None)
        elif base and not here:
            devices = sorted({b.device for b in base if b.device})
            out[r.run_id] = (None, f"no baseline run on {r.device} (it ran on {', '.join(devices)}): a speedup "
                                   f"across devices is not the format's")
        else:
            out[r.run_id] = (None, "the baseline has reported no throughput yet")
    return out


def _finite(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _pct(value: float | None, ref: float | None) -> float | None:
    return None if value is None or not ref else 100.0 * (value - ref) / ref


def _mean(values) -> float | None:
    vals = [v for v in (_finite(x) for x in values) if v is not None]
    return statistics.fmean(vals) if vals else None


def check_tolerance(tolerance_pct) -> float:
    """The stated tolerance as a float in (0, 100], or a ValueError that says what is wrong."""
    tol = _finite(tolerance_pct)
    if tol is None or not 0 < tol <= 100:
        raise ValueError(f"the verdict tolerance must be a number of percent in (0, 100], e.g. 1.0 for ±1% of BF16's "
                         f"validation loss; got {tolerance_pct!r}")
    return tol


def experiment_verdict(runs: Sequence[RunFacts], *, reference_run_id: int | None,
                       tolerance_pct: float = DEFAULT_TOLERANCE_PCT) -> dict:
    """The verdict of one experiment (see the module docstring): the baseline's reference and seed band, the rule
    used, one entry per non-baseline variant, and a one-line summary."""
    tol = check_tolerance(tolerance_pct)
    base_runs = [r for r in runs if r.is_baseline]
    ref = next((r for r in base_runs if r.run_id == reference_run_id), None)
    # Only finished runs are judged: a run still training has the validation loss of an earlier point of training.
    ref_loss = _finite(ref.final_val_loss) if ref and ref.status == "succeeded" else None
    base_deltas = _deltas(_one_per_seed([r for r in base_runs if r.status == "succeeded"], reference_run_id),
                          ref_loss)
    band = seed_band(base_deltas)
    rule = "seed_band" if band is not None else "tolerance"
    base_tps = _mean(r.tokens_per_s for r in base_runs if r.status == "succeeded") or _mean(
        r.tokens_per_s for r in base_runs)
    speed = speedups(runs)
    ref_lowest = _finite(ref.min_val_loss) if ref_loss is not None else None
    variants: dict[str, list[RunFacts]] = {}
    for r in runs:
        if not r.is_baseline:
            variants.setdefault(r.variant, []).append(r)
    ref_seed = ref.seed if ref else None
    entries = [_variant_entry(name, members, ref_loss, ref_lowest, ref_seed, speed, base_deltas, tol)
               for name, members in variants.items()]
    spread = _accuracy_spread(base_runs, reference_run_id)
    for e in entries:
        for row in e["accuracy"]:
            row["baseline_seed_spread"] = spread.get((row["task"], row["metric"]))
    out = {
        "reference_run_id": ref.run_id if ref else None,
        "baseline": {"run_ids": [r.run_id for r in base_runs], "seeds": sorted({r.seed for r in base_runs}),
                     "final_val_loss": ref_loss, "tokens_per_s": base_tps},
        "rule": rule, "tolerance_pct": tol, "band_pct": band,
        "rule_text": _rule_text(rule, band, tol, len(base_deltas)),
        "recipes": entries,
        "runs": [_run_entry(r, ref_loss, speed[r.run_id], spread) for r in runs],
    }
    out["best"], out["summary"] = _summary(out, ref, ref_loss)
    return out


def _one_per_seed(runs: Sequence[RunFacts], first_id: int | None = None) -> list[RunFacts]:
    """One run per seed (the run `first_id`, then the earliest): two runs of one seed are one sample of the
    seed-to-seed spread, not two (a band from a seed counted twice would be too narrow)."""
    seen: set[int] = set()
    out = []
    for r in sorted(runs, key=lambda r: (r.run_id != first_id, r.run_id)):
        if r.seed not in seen:
            seen.add(r.seed)
            out.append(r)
    return out


def _deltas(runs: Sequence[RunFacts], ref_loss: float | None) -> list[float]:
    """The runs' final val-loss deltas to the reference (percent), those that have one."""
    deltas = [_pct(_finite(r.final_val_loss), ref_loss) for r in runs]
    return [d for d in deltas if d is not None]


def seed_band(base_deltas: Sequence[float], recipe_deltas: Sequence[float] = (),
              confidence: float = SEED_BAND_CONFIDENCE) -> list[float] | None:
    """The band a recipe's pooled delta is judged by (module docstring): BF16's mean delta ± the two-sample t
    interval's half-width for a recipe pooled over max(1, len(recipe_deltas)) seeds; None with fewer than two
    BF16 seeds. A recipe with 2+ seeds adds its own spread to the pooled standard deviation (and its degrees of
    freedom)."""
    n, k = len(base_deltas), len(recipe_deltas)
    if n < 2:
        return None
    from scipy.stats import t as student_t

    centre = statistics.fmean(base_deltas)
    ss = sum((d - centre) ** 2 for d in base_deltas)
    df = n - 1
    if k >= 2:
        recipe_mean = statistics.fmean(recipe_deltas)
        ss += sum((d - recipe_mean) ** 2 for d in recipe_deltas)
        df += k - 1
    half = float(student_t.ppf(0.5 + confidence / 2, df)) * math.sqrt(ss / df) * math.sqrt(1 / n + 1 / max(k, 1))
    return [centre - half, centre + half]


def classify(delta_pct: float | None, band: list[float] | None, tolerance_pct: float) -> str | None:
    """"matches", "better" (lower loss beyond the band) or "worse"; None without a delta."""
    if delta_pct is None:
        return None
    low, high = band if band is not None else (-tolerance_pct, tolerance_pct)
    # A rounding hair outside the band (1e-9 %) is inside (with identical BF16 seeds the band is one point).
    if delta_pct < low - 1e-9:
        return "better"
    return "worse" if delta_pct > high + 1e-9 else "matches"


def _variant_entry(name: str, members: list[RunFacts], ref_loss, ref_lowest, ref_seed, speed, base_deltas,
                   tol) -> dict:
    """A recipe variant's figures (its finished seeds pooled) and its outcome by the rule: BF16's seed band for its
    number of finished seeds with 2+ BF16 deltas in `base_deltas`, else the tolerance. `speed`: `speedups`'s
    answer for every run."""
    done = [r for r in members if r.status == "succeeded"]
    final = _mean(r.final_val_loss for r in done)
    lowest = _mean(r.min_val_loss for r in done)
    tps = _mean(r.tokens_per_s for r in done) or _mean(r.tokens_per_s for r in members)
    timed = done if any(speed[r.run_id][0] is not None for r in done) else members
    speedup = _mean(speed[r.run_id][0] for r in timed)
    speedup_note = None if speedup is not None else next(
        (speed[r.run_id][1] for r in members if speed[r.run_id][1]), None)
    delta = _pct(final, ref_loss)
    diverged = [r.run_id for r in members if r.status == "diverged"]
    band = seed_band(base_deltas, _deltas(_one_per_seed(done), ref_loss))
    outcome = "diverged" if diverged else classify(delta, band, tol)
    # "matches" inside a seed band wider than the stated tolerance: the runs cannot tell the recipe from BF16 at the
    # precision the experiment asked for (more seeds or steps narrow the band)
    resolved = outcome != "matches" or band is None or (band[1] - band[0]) / 2 <= tol + 1e-9
    # Its accuracy is the run paired with the reference: the same seed (initial weights and batch order).
    first = next((r for r in members if r.seed == ref_seed), min(members, key=lambda r: r.run_id))
    return {
        "variant": name, "recipe": first.recipe, "run_ids": [r.run_id for r in members],
        "seeds": sorted({r.seed for r in members}), "statuses": sorted({r.status for r in members}),
        "emulated": any(r.emulated for r in members),
        "final_val_loss": final, "min_val_loss": lowest,
        "val_delta_pct": delta, "min_val_delta_pct": _pct(lowest, ref_lowest), "band_pct": band,
        "tokens_per_s": tps, "speedup": speedup, "speedup_note": speedup_note,
        "speed_word": None if speedup is None else ("speedup" if speedup >= 1 else "slowdown"),
        "outcome": outcome, "matches": None if outcome is None else outcome in ("matches", "better"),
        "resolved": resolved if outcome is not None else None,
        "accuracy": [_accuracy_row(row) for row in first.accuracy],
    }


def _run_entry(r: RunFacts, ref_loss, speed: tuple, spread: dict) -> dict:
    """One run of the decision table: its own figures against the reference (no pooling over seeds); `speed` is
    its (speedup, why none) from `speedups`."""
    final, tps = _finite(r.final_val_loss), _finite(r.tokens_per_s)
    rows = [_accuracy_row(row) for row in r.accuracy]
    for row in rows:
        row["baseline_seed_spread"] = spread.get((row["task"], row["metric"]))
    return {"run_id": r.run_id, "variant": r.variant, "recipe": r.recipe, "seed": r.seed, "status": r.status,
            "is_baseline": r.is_baseline, "emulated": r.emulated, "final_val_loss": final,
            "min_val_loss": _finite(r.min_val_loss), "val_delta_pct": _pct(final, ref_loss),
            "tokens_per_s": tps, "speedup": speed[0], "speedup_note": speed[1], "device": r.device,
            "accuracy": rows}


def _accuracy_row(row: dict) -> dict:
    keys = ("task", "metric", "delta", "ci_low", "ci_high", "p_value", "p_holm", "significant",
            "significant_uncorrected", "improved", "higher_is_better", "n", "method")
    return {k: row.get(k) for k in keys}


def _accuracy_spread(base_runs: Sequence[RunFacts], reference_run_id) -> dict:
    """(task, metric) -> [min, max] of the baseline replicates' accuracy deltas to the reference (its own 0
    included): the seed-to-seed spread an accuracy difference of a recipe is read against. Only with 2+ seeds."""
    deltas: dict[tuple, list[float]] = {}
    for r in base_runs:
        if r.run_id == reference_run_id:
            continue
        for row in r.accuracy:
            d = _finite(row.get("delta"))
            if d is not None:
                deltas.setdefault((row.get("task"), row.get("metric")), [0.0]).append(d)
    return {k: [min(v), max(v)] for k, v in deltas.items()}


def _rule_text(rule: str, band, tol: float, n_seeds: int) -> str:
    # A clause that stands alone: the dashboard shows it as "Rule: <text>.", the summary in brackets.
    if rule == "seed_band":
        return (f"a recipe matches BF16 when its final validation-loss difference lies inside BF16's seed band, "
                f"[{band[0]:+.2f}%, {band[1]:+.2f}%] for a one-seed recipe ({SEED_BAND_CONFIDENCE:.0%} t interval "
                f"from {n_seeds} BF16 seeds; a recipe with more seeds gets its own band)")
    return (f"with one BF16 seed, a recipe matches BF16 when its final validation-loss difference is within "
            f"±{tol:g}% (the experiment's stated tolerance)")


def _summary(out: dict, ref: RunFacts | None, ref_loss: float | None) -> tuple[dict | None, str]:
    entries = out["recipes"]
    if ref is None:
        return None, "no BF16 run to compare with"
    if ref.status != "succeeded":
        return None, f"BF16 is {ref.status}: the verdict waits for its final validation loss"
    if ref_loss is None:
        return None, ("BF16 has no validation loss: the verdict needs val/loss (training.val_batches >= 1, which "
                      "every run validates at its end with)")
    judged = [e for e in entries if e["outcome"] is not None]
    if not judged:
        return None, "no recipe has finished with a validation loss yet"
    good = [e for e in judged if e["matches"]]
    if not good:
        return None, f"no recipe matches BF16's validation loss ({out['rule_text']})"
    if not any(e["resolved"] for e in good):
        return None, _unresolved_summary(out, good, judged)
    best = max((e for e in good if e["resolved"]), key=_headline_rank)
    speed = ("speed not measured" if best["speedup"] is None
             else f"{best['speedup']:.2f}× BF16's throughput ({best['speed_word']})")
    if best["emulated"] and best["speedup"] is not None:
        speed += " on emulated GEMMs, not the format's hardware speed"
    word = "beats" if best["outcome"] == "better" else "matches"
    others = [e["variant"] for e in good if e is not best]
    also = f"; also within the rule: {', '.join(others)}" if others else ""
    return ({"variant": best["variant"], "run_ids": best["run_ids"]},
            f"{best['variant']} {word} BF16 at {best['val_delta_pct']:+.2f}% final validation loss, {speed}"
            f"{_accuracy_clause(best['accuracy'])}{also}; rule: {out['rule_text']}")


def _unresolved_summary(out: dict, good: list[dict], judged: list[dict]) -> str:
    """The summary when every recipe that matches lies inside a seed band wider than the experiment's tolerance: no
    recipe is named as the one to take, since these runs cannot tell them from BF16 (or from each other)."""
    band, tol = out["band_pct"], out["tolerance_pct"]
    names = [e["variant"] for e in good]
    worse = [e["variant"] for e in judged if e["outcome"] in ("worse", "diverged")]
    accuracy = [f"{e['variant']} on {', '.join(_worse_tasks(e['accuracy']))}" for e in good if _worse_tasks(e["accuracy"])]
    return (f"not conclusive at the experiment's ±{tol:g}% tolerance: {', '.join(names)} "
            f"{'lies' if len(names) == 1 else 'lie'} inside BF16's seed band [{band[0]:+.2f}%, {band[1]:+.2f}%], "
            f"wider than that - more BF16 seeds or longer runs narrow it"
            + (f"; accuracy significantly worse: {'; '.join(accuracy)}" if accuracy else "")
            + (f"; worse than BF16: {', '.join(worse)}" if worse else "") + f"; rule: {out['rule_text']}")


def _headline_rank(entry: dict) -> tuple:
    """Which matching recipe the summary names: one whose accuracy is not significantly worse anywhere, then the
    fastest on real GEMMs (an emulated recipe's throughput says nothing of its format's hardware speed, so it
    ranks as unmeasured), then the lowest validation loss."""
    real_speed = entry["speedup"] if entry["speedup"] is not None and not entry["emulated"] else -1.0
    delta = entry["val_delta_pct"] if entry["val_delta_pct"] is not None else math.inf
    return (not _worse_tasks(entry["accuracy"]), real_speed, -delta)


def _worse_tasks(rows: Sequence[dict]) -> list[str]:
    return sorted({r["task"] for r in rows if r.get("significant") and r.get("improved") is False})


def _accuracy_clause(rows: Sequence[dict]) -> str:
    """What the paired accuracy comparison adds to the verdict line (Holm-corrected significance)."""
    tasks = sorted({r["task"] for r in rows})
    if not tasks:
        return ""
    worse = _worse_tasks(rows)
    if worse:
        return f", but accuracy significantly worse on {', '.join(worse)}"
    return f", no significant accuracy loss on {len(tasks)} evaluated task{'s' if len(tasks) > 1 else ''}"
