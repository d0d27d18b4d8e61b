"""The verdict's seed band (training.evaluation.verdict): how often it calls a recipe that trains exactly like BF16
"better" or "worse", and that it still finds a real difference.

A recipe identical to BF16 is simulated as more draws from BF16's own distribution of final validation losses.
The min-max band of n BF16 seeds (the rule before) calls such a one-seed recipe better or worse with probability
2 / (n + 1), 50% with three seeds; the t band is to do so 5% of the time."""
from __future__ import annotations

import math
import random

import pytest

from training.evaluation.verdict import RunFacts, classify, experiment_verdict, seed_band

T975_2DF = 4.302652729749462  # Student's t, 0.975 quantile, 2 degrees of freedom (tables)


def _false_call_rate(n_bf16: int, k_recipe: int, trials: int, rng: random.Random) -> float:
    calls = 0
    for _ in range(trials):
        base = [rng.gauss(2.0, 0.01) for _ in range(n_bf16)]
        recipe = [rng.gauss(2.0, 0.01) for _ in range(k_recipe)]
        ref = base[0]
        pct = [100 * (v - ref) / ref for v in base]
        rpct = [100 * (v - ref) / ref for v in recipe]
        delta = 100 * (sum(recipe) / k_recipe - ref) / ref
        calls += classify(delta, seed_band(pct, rpct), 1.0) != "matches"
    return calls / trials


@pytest.mark.parametrize("n_bf16, k_recipe", [(2, 1), (3, 1), (5, 1), (3, 3)])
def test_a_recipe_that_trains_like_bf16_is_called_better_or_worse_5_percent_of_the_time(n_bf16, k_recipe):
    rate = _false_call_rate(n_bf16, k_recipe, 6000, random.Random(n_bf16 * 10 + k_recipe))
    # 6000 trials: the rate's standard error at 5% is 0.28 percentage points. The min-max band would give 67%,
    # 50%, 33% and (three seeds pooled against three) ~10%.
    assert 0.04 <= rate <= 0.06, rate


def test_a_real_difference_is_found():
    """Five BF16 seeds and a recipe whose loss is 6 seed standard deviations higher: called worse nearly always
    (a t statistic of 6 / sqrt(1.2) against the 2.78 threshold of 4 d.f.)."""
    rng = random.Random(7)
    worse = 0
    for _ in range(2000):
        base = [rng.gauss(2.0, 0.01) for _ in range(5)]
        recipe = rng.gauss(2.06, 0.01)
        pct = [100 * (v - base[0]) / base[0] for v in base]
        worse += classify(100 * (recipe - base[0]) / base[0], seed_band(pct), 1.0) == "worse"
    assert worse / 2000 > 0.9


def test_the_band_is_the_two_sample_t_interval():
    # BF16 at 0, +1.5, -0.5 %: mean 1/3, sd sqrt(13/12); a one-seed recipe: 1/3 ± t(2) sd sqrt(1 + 1/3).
    half = T975_2DF * math.sqrt(13 / 12) * math.sqrt(4 / 3)
    assert seed_band([0.0, 1.5, -0.5]) == pytest.approx([1 / 3 - half, 1 / 3 + half])
    # A recipe with two seeds at +1 and +2 %: its spread pooled in (sum of squares 13/6 + 1/2 over 3 d.f.).
    from scipy.stats import t as student_t

    s_p = math.sqrt((13 / 6 + 0.5) / 3)
    half2 = student_t.ppf(0.975, 3) * s_p * math.sqrt(1 / 3 + 1 / 2)
    assert seed_band([0.0, 1.5, -0.5], [1.0, 2.0]) == pytest.approx([1 / 3 - half2, 1 / 3 + half2])
    assert seed_band([0.0]) is None
    # Identical seeds: a band of one point, and any difference is outside it.
    assert seed_band([0.0, 0.0]) == [0.0, 0.0]
    assert classify(0.01, [0.0, 0.0], 1.0) == "worse" and classify(0.0, [0.0, 0.0], 1.0) == "matches"


def test_each_recipe_is_judged_by_the_band_for_its_own_seeds():
    def run(run_id, recipe, seed, loss, baseline=False):
        return RunFacts(run_id=run_id, variant=recipe, recipe=recipe, status="succeeded", seed=seed,
                        is_baseline=baseline, final_val_loss=loss, tokens_per_s=1000.0)

    runs = [run(1, "bf16", 0, 2.0, True), run(2, "bf16", 1, 2.03, True), run(3, "bf16", 2, 1.99, True),
            run(4, "fp8_tensorwise", 0, 2.02), run(5, "nvfp4", 0, 2.02), run(6, "nvfp4", 1, 2.04),
            run(7, "mxfp8", 0, 2.12)]
    v = experiment_verdict(runs, reference_run_id=1)
    assert v["rule"] == "seed_band"
    by = {e["recipe"]: e for e in v["recipes"]}
    assert v["band_pct"] == pytest.approx(seed_band([0.0, 1.5, -0.5]))
    assert by["fp8_tensorwise"]["band_pct"] == pytest.approx(v["band_pct"])
    assert by["nvfp4"]["band_pct"] == pytest.approx(seed_band([0.0, 1.5, -0.5], [1.0, 2.0]))
    assert by["nvfp4"]["val_delta_pct"] == pytest.approx(1.5)
    assert [by[r]["outcome"] for r in ("fp8_tensorwise", "nvfp4", "mxfp8")] == ["matches", "matches", "worse"]
    assert "95% t interval from 3 BF16 seeds" in v["rule_text"]
    # One BF16 seed: the tolerance rule, and no band anywhere.
    one = experiment_verdict([runs[0], runs[3]], reference_run_id=1)
    assert one["rule"] == "tolerance" and one["band_pct"] is None and one["recipes"][0]["band_pct"] is None


def test_the_headline_ranks_real_gemm_speed_not_emulated_throughput():
    """Among the recipes within the rule the summary names the fastest on real GEMMs; an emulated recipe's
    throughput (BF16/FP32 GEMMs on dequantized values, perhaps sharing the CPU with other runs) ranks as unmeasured,
    so between emulated ones the lower validation loss is named - and the others within the rule are listed."""
    def run(run_id, recipe, loss, tps, emulated, baseline=False):
        return RunFacts(run_id=run_id, variant=recipe, recipe=recipe, status="succeeded", seed=0,
                        is_baseline=baseline, final_val_loss=loss, tokens_per_s=tps, emulated=emulated)

    base = run(1, "bf16", 2.0, 1000.0, False, baseline=True)
    fast_emulated, better_emulated = run(2, "mxfp8", 2.015, 900.0, True), run(3, "nvfp4", 2.005, 400.0, True)
    v = experiment_verdict([base, fast_emulated, better_emulated], reference_run_id=1)
    assert v["summary"].startswith("nvfp4 matches BF16 at +0.25% final validation loss, 0.40× BF16's throughput "
                                   "(slowdown) on emulated GEMMs, not the format's hardware speed")
    assert "; also within the rule: mxfp8; rule:" in v["summary"]
    real = run(4, "fp8_tensorwise", 2.018, 1300.0, False)
    v = experiment_verdict([base, fast_emulated, better_emulated, real], reference_run_id=1)
    assert v["summary"].startswith("fp8_tensorwise matches BF16 at +0.90% final validation loss, 1.30× BF16's")
    assert "also within the rule: mxfp8, nvfp4" in v["summary"]


def test_a_band_wider_than_the_tolerance_names_no_recipe():
    """The demo's case: three BF16 seeds of a short CPU run spread by 3%, so the band is about ±9% and every recipe
    "matches". That is not an equivalence at the experiment's 1% tolerance: the summary says the runs cannot tell,
    names no recipe to take, and each entry carries resolved=False (the dashboard shows "inside BF16's noise")."""
    def run(run_id, recipe, seed, loss, baseline=False):
        return RunFacts(run_id=run_id, variant=recipe, recipe=recipe, status="succeeded", seed=seed,
                        is_baseline=baseline, final_val_loss=loss, tokens_per_s=1000.0, emulated=not baseline)

    wide = [run(1, "bf16", 0, 5.0285, True), run(2, "bf16", 1, 5.0526, True), run(3, "bf16", 2, 5.1986, True),
            run(4, "fp8_tensorwise", 0, 4.9320), run(5, "mxfp8", 0, 4.9186), run(6, "nvfp4", 0, 5.9)]
    v = experiment_verdict(wide, reference_run_id=1)
    by = {e["recipe"]: e for e in v["recipes"]}
    assert [by[r]["outcome"] for r in ("fp8_tensorwise", "mxfp8", "nvfp4")] == ["matches", "matches", "worse"]
    assert by["fp8_tensorwise"]["resolved"] is False and by["nvfp4"]["resolved"] is True and v["best"] is None
    assert v["summary"].startswith("not conclusive at the experiment's ±1% tolerance: fp8_tensorwise, mxfp8 lie "
                                   "inside BF16's seed band [-7.81%, +10.38%], wider than that")
    assert "; worse than BF16: nvfp4; rule:" in v["summary"]
    # the same seeds at a stated tolerance of 10%: resolved, and a recipe is named
    loose = experiment_verdict(wide, reference_run_id=1, tolerance_pct=10)
    assert loose["best"]["variant"] in ("fp8_tensorwise", "mxfp8") and "matches BF16 at" in loose["summary"]
