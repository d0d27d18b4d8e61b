"""Paired comparison of two models evaluated on the same documents (a recipe against BF16).

Both runs score the *same* documents, so the comparison is paired: per-document differences
cancel the document difficulty, which makes a paired test far more sensitive than comparing
two accuracies with their separate stderrs.

Methods
-------
``bootstrap`` (default, any metric)
    Paired percentile bootstrap: resample document indices with replacement (the same
    indices for both runs), recompute the statistic of each run, take the difference.
    The (1 - alpha) interval is the alpha/2 and 1 - alpha/2 percentiles of the resampled
    differences; the two-sided p-value is ``2 * min(P*(d <= 0), P*(d >= 0))`` (capped at 1),
    so ``p < alpha`` exactly when the interval excludes 0. Significant = the interval
    excludes 0. With ``strata`` (a group such as BLiMP or MMLU: one stratum per leaf task) the
    resampling is done within each stratum and the statistic is the mean of the per-stratum
    statistics, unweighted (lm-eval's ``weight_by_size: false``, BLiMP) or weighted by each
    stratum's document count (``weight_by_size: true``, lm-eval's default and MMLU's): the
    number lm-eval reports for the group. lm-eval 0.4 aggregates a group over all its leaf
    tasks, whatever subgroups lie between, with the group's own flag; so do the group rows of
    :func:`compare_results` (the flag comes from the group record's ``weight_by_size``; records
    stored without it are taken as unweighted, as they always were).
``mcnemar`` (binary 0/1 outcomes only)
    Exact McNemar test: with b = #(baseline right, candidate wrong) and c = #(baseline wrong,
    candidate right), under H0 c ~ Binomial(b + c, 1/2); the p-value is the exact two-sided
    binomial test. The interval is the Wald interval of the paired difference ``(c - b) / n``
    with standard error ``sqrt(b + c - (c - b)^2 / n) / n`` (an interval conditional on
    b + c, e.g. Clopper-Pearson on c / (b + c), cannot exceed the observed difference when
    b = 0). Significant = ``p < alpha``; with very few discordant pairs the exact p-value
    and the approximate interval can disagree, and the p-value is the one to trust.

Statistics (how per-document values turn into the task's number, as lm-eval aggregates):
``mean`` (accuracies; values 0/1 or floats), ``perplexity`` (values are log-likelihoods;
``exp(-mean)``), ``weighted_perplexity`` and ``bits_per_byte`` (values are
``[loglikelihood, weight]`` pairs; ``exp(-sum ll / sum w)`` and ``-sum ll / sum w / ln 2``).

Identical inputs give delta 0, interval [0, 0], p-value 1 and "not significant".

Pairing and multiple comparisons (:func:`compare_results`)
----------------------------------------------------------
A pair is only made when both runs scored the same documents: the same lm-eval task hash
(a digest of every document, prompt and target, independent of the model) and the same
documents; otherwise :class:`PairingError` says why (a paired test on different documents
would measure the documents, not the recipe). One candidate-vs-baseline comparison tests
every shared task and metric, so its rows form one family: each row keeps its uncorrected
``p_value`` and gets the Holm-adjusted ``p_holm``; ``significant`` is ``p_holm < alpha``
(family-wise error rate alpha), ``significant_uncorrected`` the single-test decision. The
intervals are per-row (1 - alpha) intervals, not simultaneous ones.

What the interval covers: the sampling of *documents* for these two checkpoints. Two
trainings of one recipe with different seeds give different checkpoints; that variation is
only measured by seed replicates, never by this interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

STATISTICS = ("mean", "perplexity", "weighted_perplexity", "bits_per_byte")
METHODS = ("bootstrap", "mcnemar")
# The one resample count of the paired bootstrap (API, dashboard and `plab eval --compare`): with 10,000
# resamples the smallest p-value is 2 / 10,001 (~2e-4; a Monte-Carlo p is never 0), so a Holm adjustment over
# tens of tasks (p x m) can still reach 0.05, and the 2.5% percentile rests on 250 resamples (its Monte-Carlo
# error is ~1% of the width).
DEFAULT_N_BOOT = 10_000


class PairingError(ValueError):
    """The two runs did not score the same documents, so no paired difference exists."""

# Resampled index matrices are built in chunks of at most this many entries (~40 MB of int64).
_CHUNK_ENTRIES = 5_000_000


def paired_difference(
    baseline: Sequence,
    candidate: Sequence,
    *,
    method: str = "bootstrap",
    statistic: str = "mean",
    n_boot: int = DEFAULT_N_BOOT,
    seed: int = 0,
    alpha: float = 0.05,
    strata: Sequence | None = None,
    weight_by_size: bool = False,
) -> dict:
    """Difference ``statistic(candidate) - statistic(baseline)`` with a (1 - alpha) interval.

    ``baseline`` and ``candidate`` are per-document values aligned by position (document i
    of one is document i of the other). Returns ``{"method", "statistic", "n", "alpha",
    "baseline", "candidate", "delta", "ci_low", "ci_high", "p_value", "significant"}`` and,
    for McNemar, ``"discordant": {"baseline_only": b, "candidate_only": c}``. ``strata``: one
    label per document (a group's leaf tasks); ``weight_by_size`` weights each stratum's
    statistic by its document count instead of equally.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    if not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), e.g. 0.05 for a 95% interval; got {alpha!r}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 100:
        raise ValueError(f"n_boot must be an integer >= 100 (10,000 is a good default), got {n_boot!r}")
    a = _as_columns(baseline, statistic, "baseline")
    b = _as_columns(candidate, statistic, "candidate")
    if a.shape != b.shape:
        raise ValueError(
            f"baseline has {a.shape[0]} documents and candidate {b.shape[0]}; a paired test needs the same "
            "documents in the same order (align them by doc_id first, see compare_results)"
        )
    groups = _strata_indices(strata, a.shape[0])
    weights = _stratum_weights(groups, weight_by_size)

    result: dict[str, Any] = {
        "method": method,
        "statistic": statistic,
        "n": int(a.shape[0]),
        "alpha": float(alpha),
        "baseline": _grouped_statistic(a, groups, statistic, weights),
        "candidate": _grouped_statistic(b, groups, statistic, weights),
    }
    result["delta"] = result["candidate"] - result["baseline"]
    if method == "mcnemar":
        result.update(_mcnemar(a, b, statistic, alpha, groups, weight_by_size))
    else:
        result.update(_bootstrap(a, b, groups, weights, statistic, n_boot, seed, alpha))
    return result


def compare_results(
    baseline: dict,
    candidate: dict,
    *,
    tasks: Sequence[str] | None = None,
    method: str = "bootstrap",
    n_boot: int = DEFAULT_N_BOOT,
    seed: int = 0,
    alpha: float = 0.05,
) -> list[dict]:
    """Accuracy table rows: every task and metric both evaluations share, candidate vs baseline.

    ``baseline``/``candidate`` are :func:`training.evaluation.evaluate_checkpoint` results
    (or just their ``"tasks"`` dicts). Documents are matched by ``doc_id``; both runs must
    have scored the same documents (same task hash, same document count, same doc_ids), else
    :class:`PairingError`. ``method="mcnemar"`` applies to the binary metrics; the others use
    the bootstrap (each row names its method). Rows: ``{"task", "metric", "higher_is_better",
    "improved", **paired_difference(...), "p_holm", "significant_uncorrected", "family_size"}``
    where ``significant`` is Holm-corrected over the rows (see the module docstring) and
    ``improved`` says whether the candidate is significantly better (by ``higher_is_better``).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    base_tasks = baseline.get("tasks", baseline)
    cand_tasks = candidate.get("tasks", candidate)
    names = list(tasks) if tasks is not None else [t for t in base_tasks if t in cand_tasks]
    rows = []
    for name in names:
        if name not in base_tasks or name not in cand_tasks:
            missing = "baseline" if name not in base_tasks else "candidate"
            raise ValueError(f"task {name!r} is not in the {missing} results; evaluate it there first")
        base, cand = base_tasks[name], cand_tasks[name]
        check_same_documents(name, base, cand)
        for metric, agg in base.get("aggregation", {}).items():
            if agg not in STATISTICS or metric not in cand.get("aggregation", {}):
                continue
            a, b, strata = _aligned(name, metric, base, cand, base_tasks, cand_tasks)
            if not a:
                continue
            by_size = strata is not None and bool((base.get("weight_by_size") or {}).get(metric, False))
            binary = agg == "mean" and all(v in (0.0, 1.0) for v in a + b)
            row_method = "mcnemar" if method == "mcnemar" and binary else "bootstrap"
            if (row_method == "mcnemar" and strata is not None and not by_size
                    and len(set(np.bincount(_codes(strata)))) > 1):
                row_method = "bootstrap"  # pooled McNemar would misweight unequal subtasks
            diff = paired_difference(
                a, b, method=row_method, statistic=agg, n_boot=n_boot, seed=seed, alpha=alpha, strata=strata,
                weight_by_size=by_size,
            )
            higher = base.get("higher_is_better", {}).get(metric)
            rows.append({"task": name, "metric": metric, "higher_is_better": higher, **diff})
    for row, p_holm in zip(rows, holm_adjust([r["p_value"] for r in rows])):
        row["significant_uncorrected"] = row["significant"]
        row["p_holm"] = p_holm
        row["significant"] = bool(p_holm < alpha)
        row["family_size"] = len(rows)
        higher = row["higher_is_better"]
        row["improved"] = (row["delta"] > 0) == bool(higher) if row["significant"] and higher is not None else None
    return rows


def holm_adjust(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: sorted ascending p_(1) <= ... <= p_(m), the
    adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)). Rejecting where the adjusted p < alpha keeps the
    probability of any false rejection among the m tests <= alpha (Holm 1979), without Bonferroni's loss of power."""
    p = [float(v) for v in p_values]
    if any(not 0 <= v <= 1 for v in p):
        raise ValueError(f"p-values must lie in [0, 1], got {p}")
    m = len(p)
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda k: p[k])):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted


def check_same_documents(name: str, base: dict, cand: dict) -> None:
    """PairingError unless both runs' results of task `name` come from the same documents scored the same way:
    equal lm-eval task hashes (where both have one), equal evaluation dtypes (where both record one), for a
    perplexity-type task (bits per byte) the same window length (a result that records none was windowed at
    lm-eval's max_length, before the trained context was), and equal document counts."""
    bh, ch = base.get("task_hash"), cand.get("task_hash")
    if bh and ch and bh != ch:
        raise PairingError(f"task {name!r}: the two runs scored different documents or prompts (task hash "
                           f"{bh[:12]}… vs {ch[:12]}…); evaluate both checkpoints with the same task version and "
                           "the same --limit, then compare")
    bd, cd = ((r.get("eval_settings") or {}).get("dtype") if isinstance(r.get("eval_settings"), dict) else None
              for r in (base, cand))
    if bd and cd and bd != cd:
        raise PairingError(f"task {name!r}: the baseline was scored in {bd} and the candidate in {cd} (the model's "
                           "dtype during evaluation moves the scores by itself); evaluate both in one dtype "
                           "(plab eval --dtype) on the same kind of device, then compare")
    if _rolling(base) or _rolling(cand):
        bw, cw = (_settings(r).get("rolling_context") for r in (base, cand))
        if bw != cw:
            raise PairingError(f"task {name!r}: the baseline's text was scored in windows of {_windows(bw)} and the "
                               f"candidate's in {_windows(cw)} (the window length moves bits per byte by itself); "
                               "evaluate both at one window length (plab eval --rolling-context N; the worker uses "
                               "the run's data.seq_len), then compare")
    bn, cn = base.get("n_samples"), cand.get("n_samples")
    if bn is not None and cn is not None and bn != cn:
        raise PairingError(f"task {name!r}: the baseline scored {bn} documents and the candidate {cn}; evaluate "
                           "both with the same --limit (a paired test needs the same documents)")


# --------------------------------------------------------------------------- internals
ROLLING_METRICS = ("bits_per_byte", "byte_perplexity", "word_perplexity")


def _settings(result: dict) -> dict:
    settings = result.get("eval_settings")
    return settings if isinstance(settings, dict) else {}


def _rolling(result: dict) -> bool:
    """Whether a task result is a perplexity-type (loglikelihood_rolling) task's: scored in windows of text."""
    metrics = result.get("metrics")
    return isinstance(metrics, dict) and any(m in metrics for m in ROLLING_METRICS)


def _windows(length) -> str:
    return f"{length} tokens" if length is not None else "the model's max_length (not recorded: an older evaluation)"



def _aligned(name, metric, base, cand, base_tasks, cand_tasks):
    """Per-document values of both runs on their common documents (+ strata for groups: the leaf task of each
    document, through any subgroups, as lm-eval aggregates a group over its leaf tasks)."""
    if base.get("kind") == "group":
        a_all, b_all, strata = [], [], []
        for sub in base.get("subtasks", []):
            if sub in base_tasks and sub in cand_tasks:
                check_same_documents(sub, base_tasks[sub], cand_tasks[sub])
                a, b, leaves = _aligned(sub, metric, base_tasks[sub], cand_tasks[sub], base_tasks, cand_tasks)
                a_all += a
                b_all += b
                strata += leaves if leaves is not None else [sub] * len(a)
        return a_all, b_all, strata
    a_map = dict(zip(base["samples"]["doc_id"], base["samples"][metric]))
    b_map = dict(zip(cand["samples"]["doc_id"], cand["samples"][metric]))
    if a_map.keys() != b_map.keys():
        only = sorted(a_map.keys() ^ b_map.keys())
        raise PairingError(f"task {name!r}: {len(only)} documents were scored by only one of the two runs (doc_id "
                           f"{', '.join(map(str, only[:5]))}{'…' if len(only) > 5 else ''}); evaluate both on the "
                           "same documents")
    common = base["samples"]["doc_id"]
    return [a_map[d] for d in common], [b_map[d] for d in common], None


def _as_columns(values: Sequence, statistic: str, label: str) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{label} values must be numbers (or [loglikelihood, weight] pairs): {err}") from err
    if arr.ndim == 0 or arr.shape[0] == 0:
        raise ValueError(f"{label} has no documents; a paired test needs at least one")
    want_pairs = statistic in ("weighted_perplexity", "bits_per_byte")
    if want_pairs and (arr.ndim != 2 or arr.shape[1] != 2):
        raise ValueError(f"statistic {statistic!r} needs [loglikelihood, weight] pairs per document in {label}")
    if not want_pairs and arr.ndim != 1:
        raise ValueError(f"statistic {statistic!r} needs one number per document in {label}, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{label} holds NaN or infinite values; drop or fix those documents first")
    if want_pairs and np.any(arr[:, 1] <= 0):
        raise ValueError(f"{label}: weights (bytes or words) must be positive")
    return arr.reshape(arr.shape[0], -1)


def _strata_indices(strata: Sequence | None, n: int) -> list[np.ndarray]:
    if strata is None:
        return [np.arange(n)]
    if len(strata) != n:
        raise ValueError(f"strata has {len(strata)} labels for {n} documents; give one label per document")
    codes = _codes(strata)
    return [np.flatnonzero(codes == k) for k in range(codes.max() + 1)]


def _codes(labels: Sequence) -> np.ndarray:
    _, codes = np.unique(np.asarray([str(s) for s in labels]), return_inverse=True)
    return codes


def _finish(means: np.ndarray, statistic: str) -> np.ndarray:
    """Column means (..., k) → the statistic (...)."""
    if statistic == "mean":
        return means[..., 0]
    if statistic == "perplexity":
        return np.exp(-means[..., 0])
    if statistic == "weighted_perplexity":
        return np.exp(-means[..., 0] / means[..., 1])
    return -means[..., 0] / means[..., 1] / math.log(2)


def _stratum_weights(groups: list[np.ndarray], weight_by_size: bool) -> np.ndarray:
    sizes = np.array([len(g) for g in groups], dtype=np.float64)
    return sizes / sizes.sum() if weight_by_size else np.full(len(groups), 1.0 / len(groups))


def _grouped_statistic(x: np.ndarray, groups: list[np.ndarray], statistic: str, weights: np.ndarray) -> float:
    return float(sum(w * _finish(x[g].mean(axis=0), statistic) for g, w in zip(groups, weights)))


def _bootstrap(a, b, groups, weights, statistic, n_boot, seed, alpha) -> dict:
    rng = np.random.default_rng(seed)
    deltas = np.zeros(n_boot)
    for g, w in zip(groups, weights):
        size = len(g)
        rows = max(1, _CHUNK_ENTRIES // size)
        for start in range(0, n_boot, rows):
            stop = min(n_boot, start + rows)
            idx = g[rng.integers(0, size, size=(stop - start, size))]
            stat_a = _finish(a[idx].mean(axis=1), statistic)
            stat_b = _finish(b[idx].mean(axis=1), statistic)
            deltas[start:stop] += w * (stat_b - stat_a)
    low, high = np.quantile(deltas, [alpha / 2, 1 - alpha / 2])
    # Two-sided Monte-Carlo p-value with the resampled tail counted as in Davison & Hinkley (1997, eq. 4.11):
    # (1 + #tail) / (B + 1), never 0 (a p of exactly 0 claims more than B resamples can show).
    tail = min(np.count_nonzero(deltas <= 0), np.count_nonzero(deltas >= 0))
    p_value = min(1.0, 2 * (1 + tail) / (n_boot + 1))
    return {
        "ci_low": float(low),
        "ci_high": float(high),
        "p_value": float(p_value),
        "significant": bool(low > 0 or high < 0),
        "n_boot": n_boot,
        "seed": seed,
    }


def _mcnemar(a, b, statistic, alpha, groups, weight_by_size=False) -> dict:
    from scipy.stats import binomtest, norm

    x, y = a[:, 0], b[:, 0]
    if statistic != "mean" or not (np.isin(x, (0.0, 1.0)).all() and np.isin(y, (0.0, 1.0)).all()):
        raise ValueError("McNemar's test needs binary 0/1 outcomes (accuracies); use method='bootstrap'")
    if not weight_by_size and len({len(g) for g in groups}) > 1:
        # Weighted by size, the group's accuracy is the pooled accuracy, which is what McNemar tests.
        raise ValueError("McNemar pools all documents, which misweights strata of unequal size; use method='bootstrap'")
    n = x.shape[0]
    b_only = int(np.sum((x == 1) & (y == 0)))
    c_only = int(np.sum((x == 0) & (y == 1)))
    disc = b_only + c_only
    p_value = float(binomtest(c_only, disc, 0.5).pvalue) if disc else 1.0
    delta = (c_only - b_only) / n
    half_width = norm.ppf(1 - alpha / 2) * math.sqrt(max(disc - (c_only - b_only) ** 2 / n, 0.0)) / n
    low, high = delta - half_width, delta + half_width
    return {
        "ci_low": float(low),
        "ci_high": float(high),
        "p_value": p_value,
        "significant": bool(p_value < alpha),
        "discordant": {"baseline_only": b_only, "candidate_only": c_only},
    }
