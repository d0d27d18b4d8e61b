"""Paired comparison against the baseline: deltas, intervals, p-values, significance."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from training.evaluation.stats import compare_results, paired_difference


def _flip(values, indices, to):
    out = list(values)
    for i in indices:
        out[i] = to
    return out


def test_a_known_accuracy_gain_lies_inside_the_interval_and_is_significant():
    rng = np.random.default_rng(1)
    baseline = (rng.random(1000) < 0.6).astype(float).tolist()
    wrong = [i for i, v in enumerate(baseline) if v == 0.0]
    candidate = _flip(baseline, wrong[:100], 1.0)  # exactly +100 right answers: delta = +0.1
    for method in ("bootstrap", "mcnemar"):
        d = paired_difference(baseline, candidate, method=method, n_boot=2000)
        assert d["delta"] == pytest.approx(0.1)
        assert d["ci_low"] < 0.1 < d["ci_high"], method
        assert d["ci_low"] > 0 and d["significant"] and d["p_value"] < 0.001, method


def test_a_bootstrap_p_value_is_never_zero():
    """15 of 100 answers flipped, all one way: no resample reaches 0, and the p-value says so as (1 + 0) / (B + 1)
    per tail (Davison & Hinkley), not 0 (the exact McNemar p is 2 x 0.5^15 = 6.1e-5)."""
    baseline = [0.0] * 30 + [1.0] * 70
    candidate = _flip(baseline, range(15), 1.0)
    d = paired_difference(baseline, candidate, method="bootstrap", n_boot=1000)
    assert d["p_value"] == pytest.approx(2 / 1001)
    exact = paired_difference(baseline, candidate, method="mcnemar")
    assert exact["p_value"] == pytest.approx(2 * 0.5 ** 15)


def test_identical_runs_give_zero_delta_and_are_not_significant():
    rng = np.random.default_rng(2)
    acc = (rng.random(500) < 0.5).astype(float).tolist()
    pairs = np.column_stack([-rng.random(500) * 1000, rng.integers(100, 5000, 500)]).tolist()
    cases = [(acc, "mean", "bootstrap"), (acc, "mean", "mcnemar"), (pairs, "bits_per_byte", "bootstrap"),
             ([p[0] for p in pairs], "perplexity", "bootstrap")]
    for values, statistic, method in cases:
        d = paired_difference(values, values, statistic=statistic, method=method, n_boot=500)
        assert d["delta"] == 0.0 and d["ci_low"] == 0.0 and d["ci_high"] == 0.0, (statistic, method)
        assert d["p_value"] == 1.0 and d["significant"] is False, (statistic, method)


def test_a_small_difference_on_few_documents_is_not_significant():
    baseline = [1.0, 0.0] * 10
    candidate = _flip(baseline, [1], 1.0)  # one more right answer out of 20
    for method in ("bootstrap", "mcnemar"):
        d = paired_difference(baseline, candidate, method=method, n_boot=2000)
        assert d["delta"] == pytest.approx(0.05) and not d["significant"], method
        assert d["ci_low"] <= 0 < d["ci_high"], method


@pytest.mark.parametrize("method", ["bootstrap", "mcnemar"])
def test_95_percent_intervals_cover_the_true_difference_about_95_percent_of_the_time(method):
    """Simulate many evaluations of two models whose true accuracies differ by 0.05."""
    rng = np.random.default_rng(3)
    n, trials, covered = 400, 200, 0
    for t in range(trials):
        base = rng.random(n) < 0.60
        # candidate: same answers except each item is re-drawn with probability 0.3,
        # correlated like two recipes of one model; true accuracy 0.65.
        redraw = rng.random(n) < 0.3
        cand = np.where(redraw, rng.random(n) < 0.60 + 0.05 / 0.3, base)
        d = paired_difference(base.astype(float), cand.astype(float), method=method, n_boot=1000, seed=t)
        covered += d["ci_low"] <= 0.05 <= d["ci_high"]
    assert 0.90 <= covered / trials <= 0.995


def test_mcnemar_p_value_is_the_exact_binomial_test():
    # 10 pairs only the baseline got right, 2 only the candidate: p = 2 * P(X <= 2 | n=12, 1/2).
    baseline = [1.0] * 10 + [0.0] * 2 + [1.0] * 30
    candidate = [0.0] * 10 + [1.0] * 2 + [1.0] * 30
    d = paired_difference(baseline, candidate, method="mcnemar")
    assert d["p_value"] == pytest.approx(2 * (1 + 12 + 66) / 4096)
    assert d["discordant"] == {"baseline_only": 10, "candidate_only": 2}
    assert d["delta"] == pytest.approx(-8 / 42) and d["significant"]
    assert d["ci_low"] < -8 / 42 < d["ci_high"] < 0


def test_bits_per_byte_statistic_matches_lm_eval_aggregation():
    from lm_eval.api.metrics import bits_per_byte, weighted_perplexity

    pairs = [(-1200.0, 400), (-3000.0, 1100), (-50.5, 20)]
    shifted = [(ll * 0.9, n) for ll, n in pairs]
    d = paired_difference(pairs, shifted, statistic="bits_per_byte", n_boot=500)
    assert d["baseline"] == pytest.approx(bits_per_byte(pairs))
    assert d["delta"] == pytest.approx(bits_per_byte(shifted) - bits_per_byte(pairs))
    w = paired_difference(pairs, pairs, statistic="weighted_perplexity", n_boot=500)
    assert w["baseline"] == pytest.approx(weighted_perplexity(pairs))


def test_strata_weight_every_subtask_equally_like_an_lm_eval_group():
    a = [1.0] * 10 + [0.0] * 2  # subtask x: 10/10, subtask y: 0/2
    strata = ["x"] * 10 + ["y"] * 2
    d = paired_difference(a, a, strata=strata, n_boot=200)
    assert d["baseline"] == pytest.approx(0.5)  # mean of 1.0 and 0.0, not 10/12
    with pytest.raises(ValueError, match="unequal size"):
        paired_difference(a, a, strata=strata, method="mcnemar")


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (([1.0, 0.0], [1.0]), {}, "same documents"),
        (([], []), {}, "no documents"),
        (([1.0, float("nan")], [1.0, 0.0]), {}, "NaN"),
        (([1.0, 0.5], [1.0, 0.0]), {"method": "mcnemar"}, "binary"),
        (([1.0], [1.0]), {"method": "t-test"}, "method must be one of"),
        (([1.0], [1.0]), {"alpha": 5}, "alpha must be in"),
        (([1.0], [1.0]), {"n_boot": 10}, "n_boot must be"),
        (([1.0], [1.0]), {"statistic": "bits_per_byte"}, "pairs"),
    ],
)
def test_bad_inputs_are_refused_with_a_fix(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        paired_difference(*args, **kwargs)


def test_comparing_evaluation_results_aligns_documents_and_finds_an_injected_change(shipped_results):
    same = compare_results(shipped_results, shipped_results, n_boot=500)
    assert {r["task"] for r in same} >= {"plab_blimp", "plab_piqa", "plab_heldout_bpb", "plab_lambada_openai"}
    assert all(r["delta"] == 0 and not r["significant"] and r["improved"] is None for r in same)

    candidate = copy.deepcopy(shipped_results)
    piqa = candidate["tasks"]["plab_piqa"]["samples"]
    piqa["acc"] = [1.0] * len(piqa["acc"])
    # Reversed document order must not matter: documents are matched by doc_id.
    for key in piqa:
        piqa[key] = piqa[key][::-1]
    rows = {(r["task"], r["metric"]): r for r in compare_results(shipped_results, candidate, n_boot=500)}
    base_acc = shipped_results["tasks"]["plab_piqa"]["metrics"]["acc"]["value"]
    assert rows[("plab_piqa", "acc")]["delta"] == pytest.approx(1.0 - base_acc)
    assert rows[("plab_piqa", "acc_norm")]["delta"] == 0
    blimp = rows[("plab_blimp", "acc")]
    assert shipped_results["tasks"]["plab_blimp"]["weight_by_size"] == {"acc": False}  # its YAML, as lm-eval's
    assert blimp["n"] == shipped_results["tasks"]["plab_blimp"]["n_samples"]
    assert blimp["baseline"] == pytest.approx(shipped_results["tasks"]["plab_blimp"]["metrics"]["acc"]["value"])
    mcnemar = {(r["task"], r["metric"]): r for r in compare_results(shipped_results, candidate, method="mcnemar")}
    assert mcnemar[("plab_piqa", "acc")]["method"] == "mcnemar"
    assert mcnemar[("plab_heldout_bpb", "bits_per_byte")]["method"] == "bootstrap"
    assert math.isfinite(mcnemar[("plab_lambada_openai", "perplexity")]["delta"])


def test_cli_compare_prints_holm_next_to_the_uncorrected_p_and_refuses_different_documents(tmp_path, capsys):
    import json

    from training.evaluation.cli import main

    def result(acc, hash_="a" * 64):
        return {"tasks": {"t": {"kind": "task", "aggregation": {"acc": "mean"}, "higher_is_better": {"acc": True},
                                "task_hash": hash_, "n_samples": len(acc),
                                "samples": {"doc_id": list(range(len(acc))), "acc": acc}}}}

    files = {}
    for name, res in (("base", result([0.0, 1.0] * 50)), ("cand", result([1.0] * 100)),
                      ("other", result([1.0] * 100, "b" * 64))):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(res))
    assert main(["--compare", str(files["base"]), str(files["cand"])]) == 0
    out = capsys.readouterr().out
    assert "p Holm" in out.splitlines()[0] and "Holm's correction over the 1 row (" in out
    assert main(["--compare", str(files["base"]), str(files["other"])]) == 2
    assert "scored different documents or prompts (task hash aaaaaaaaaaaa… vs bbbbbbbbbbbb…)" in capsys.readouterr().err


def test_cli_compare_corrects_over_the_requested_tasks_like_the_dashboard_and_names_a_bad_file(tmp_path, capsys):
    """A group's subtasks are rows of the results but not members of the Holm family (the dashboard passes the
    requested tasks); a file that is not plab eval's results is named with what is wrong, not a traceback."""
    import json

    from training.evaluation.cli import main

    def task(acc):
        return {"kind": "task", "aggregation": {"acc": "mean"}, "higher_is_better": {"acc": True},
                "task_hash": "a" * 64, "n_samples": len(acc), "samples": {"doc_id": list(range(len(acc))), "acc": acc}}

    def result(acc):
        # "g" a group of s1 and s2 (requested), "t" a task (requested); s1 and s2 are in the file as subtasks
        return {"requested": ["g", "t"], "tasks": {
            "g": {"kind": "group", "subtasks": ["s1", "s2"], "aggregation": {"acc": "mean"},
                  "higher_is_better": {"acc": True}},
            "s1": task(acc), "s2": task(acc), "t": task(acc)}}

    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    base.write_text(json.dumps(result([0.0, 1.0] * 50)))
    cand.write_text(json.dumps(result([1.0] * 100)))
    assert main(["--compare", str(base), str(cand), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["task"] for r in rows} == {"g", "t"} and {r["family_size"] for r in rows} == {2}
    for bad, message in (("[1, 2]", "not the results of plab eval --output"), ("{", "not JSON"),
                         ('{"tasks": {"x": 1}}', "not the results of plab eval --output")):
        (tmp_path / "bad.json").write_text(bad)
        assert main(["--compare", str(base), str(tmp_path / "bad.json")]) == 2
        err = capsys.readouterr().err
        assert f"--compare CANDIDATE {tmp_path / 'bad.json'}: {message}" in err and "Traceback" not in err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"requested": ["u"], "tasks": {"u": task([1.0] * 4)}}))
    assert main(["--compare", str(base), str(other)]) == 2
    assert "share no evaluated task" in capsys.readouterr().err


def test_results_scored_in_different_dtypes_are_not_paired():
    """The same checkpoint scored in float32 and in bfloat16 differs by itself (PIQA 0.520 against 0.505 on 200
    documents in a review): a paired "difference" between two such results is refused, with the fix."""
    from training.evaluation.stats import PairingError

    def result(acc, dtype):
        return {"tasks": {"t": {"kind": "task", "aggregation": {"acc": "mean"}, "higher_is_better": {"acc": True},
                                "task_hash": "a" * 64, "n_samples": len(acc), "eval_settings": {"dtype": dtype},
                                "samples": {"doc_id": list(range(len(acc))), "acc": acc}}}}

    same = compare_results(result([0.0, 1.0] * 10, "float32"), result([1.0] * 20, "float32"))
    assert len(same) == 1
    with pytest.raises(PairingError, match=r"task 't': the baseline was scored in float32 and the candidate in "
                                           r"bfloat16 .* evaluate both in one dtype"):
        compare_results(result([0.0, 1.0] * 10, "float32"), result([1.0] * 20, "bfloat16"))
    # results stored before evaluations recorded their dtype are paired as before
    old = result([1.0] * 20, "bfloat16")
    del old["tasks"]["t"]["eval_settings"]
    assert len(compare_results(result([0.0, 1.0] * 10, "float32"), old)) == 1


def test_perplexity_results_windowed_differently_are_not_paired_accuracies_are():
    """Bits per byte depends on the window length the text was scored in (the trained context since it is recorded,
    lm-eval's max_length before): two such results are not paired; a multiple-choice task's are, whatever the
    window length its result records."""
    from training.evaluation.stats import PairingError

    def bpb(window):
        settings = {"dtype": "float32", **({"rolling_context": window} if window != "unrecorded" else {})}
        return {"tasks": {"h": {"kind": "task", "aggregation": {"bits_per_byte": "bits_per_byte"},
                                "higher_is_better": {"bits_per_byte": False}, "metrics": {"bits_per_byte": {}},
                                "task_hash": "b" * 64, "n_samples": 3, "eval_settings": settings,
                                "samples": {"doc_id": [0, 1, 2], "bits_per_byte": [[-300.0, 100], [-290.0, 90],
                                                                                  [-310.0, 120]]}}}}

    def acc(window):
        return {"tasks": {"t": {"kind": "task", "aggregation": {"acc": "mean"}, "higher_is_better": {"acc": True},
                                "metrics": {"acc": {}}, "task_hash": "a" * 64, "n_samples": 20,
                                "eval_settings": {"dtype": "float32", "rolling_context": window},
                                "samples": {"doc_id": list(range(20)), "acc": [1.0] * 20}}}}

    assert len(compare_results(bpb(128), bpb(128))) == 1
    with pytest.raises(PairingError, match=r"task 'h': the baseline's text was scored in windows of 128 tokens and "
                                           r"the candidate's in 2048 tokens .* evaluate both at one window length \(plab eval "
                                           r"--rolling-context N; the worker uses the run's data.seq_len\)"):
        compare_results(bpb(128), bpb(2048))
    with pytest.raises(PairingError, match=r"windows of the model's max_length \(not recorded: an older evaluation\) "
                                           r"and the candidate's in 128 tokens"):
        compare_results(bpb("unrecorded"), bpb(128))
    assert len(compare_results(acc(128), acc(2048))) == 1


def test_plab_eval_refuses_two_commands_at_once_and_a_file_as_the_checkpoint(tmp_path, capsys):
    from training.evaluation.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--list-tasks", "--compare", "a.json", "b.json"])
    assert stop.value.code == 2 and "--list-tasks and --compare are separate commands" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ckpt", "--list-tasks"])
    assert "--list-tasks takes no checkpoint ('ckpt')" in capsys.readouterr().err
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    assert main([str(weights), "--tasks", "plab_piqa"]) == 2
    assert f"'{weights}' is a file; give the checkpoint's folder" in capsys.readouterr().err
