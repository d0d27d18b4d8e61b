"""The verdict (GET /experiments/{id}/verdict), seed replicates at creation, and the statistics behind the accuracy
comparison: pairing refused on different documents (409), Holm's correction against a hand computation."""
from __future__ import annotations

import pytest
from sqlalchemy import text

from tests.backend.test_api import create
from tests.backend.test_comparison import api, finish, send  # noqa: F401 - `api` is a fixture

from training.evaluation.stats import compare_results, holm_adjust
from training.evaluation.verdict import RunFacts, experiment_verdict, seed_band


def val_and_noisy_train(run_id_loss: float, n: int = 40, *, train_last: float | None = None):
    """Validation loss flat at `run_id_loss` (every 10 steps) and a train loss whose last sample is `train_last`."""
    points = [{"key": "val/loss", "step": s, "tokens": (s + 1) * 100, "value": run_id_loss} for s in range(9, n, 10)]
    points += [{"key": "train/loss", "step": s, "tokens": (s + 1) * 100, "value": run_id_loss} for s in range(n)]
    if train_last is not None:
        points[-1]["value"] = train_last
    return points


def verdict(api, exp_id):
    r = api.get(f"/api/v1/experiments/{exp_id}/verdict")
    assert r.status_code == 200, r.text
    return r.json()


def test_the_verdict_follows_validation_loss_and_the_stated_tolerance(api):
    exp = create(api, verdict_tolerance_pct=0.5)
    assert exp["verdict_tolerance_pct"] == 0.5 and "verdict" not in exp["training"]
    bf16, fp8, nvfp4 = (r["id"] for r in exp["runs"])
    # fp8's last train-loss sample is 5% above BF16 (noise) while its validation loss is 0.3% above: it matches.
    send(api, bf16, val_and_noisy_train(2.0))
    send(api, fp8, val_and_noisy_train(2.006, train_last=2.1))
    send(api, nvfp4, val_and_noisy_train(2.02) + [{"key": "val/loss", "step": 5, "tokens": 600, "value": 1.99}])
    finish(api, bf16, gemm_backend="bf16", tokens_per_s=1000.0)
    finish(api, fp8, tokens_per_s=700.0)
    finish(api, nvfp4, gemm_backend="emulated", tokens_per_s=1500.0)
    v = verdict(api, exp["id"])
    assert v["rule"] == "tolerance" and v["tolerance_pct"] == 0.5 and v["band_pct"] is None
    assert "±0.5%" in v["rule_text"]
    by = {e["recipe"]: e for e in v["recipes"]}
    assert by["fp8_tensorwise"]["val_delta_pct"] == pytest.approx(0.3)
    assert by["fp8_tensorwise"]["outcome"] == "matches" and by["fp8_tensorwise"]["matches"] is True
    assert by["fp8_tensorwise"]["speedup"] == pytest.approx(0.7) and by["fp8_tensorwise"]["speed_word"] == "slowdown"
    assert by["nvfp4"]["outcome"] == "worse" and by["nvfp4"]["emulated"] is True
    assert by["nvfp4"]["min_val_delta_pct"] == pytest.approx(-0.5)  # the lowest val loss over the run, 1.99
    assert v["best"]["run_ids"] == [fp8]
    assert v["summary"].startswith("fp8_tensorwise matches BF16 at +0.30% final validation loss, 0.70×")
    assert "slowdown" in v["summary"] and "±0.5%" in v["summary"]
    assert api.get("/api/v1/experiments/999999/verdict").status_code == 404
    # `plab demo` prints the same verdict: its table reads the endpoint's answer.
    from plab.cli.demo import _summary_table

    table = _summary_table(api.get(f"/api/v1/experiments/{exp['id']}").json(), v).splitlines()
    fp8_line = next(line for line in table if line.startswith("fp8_tensorwise"))
    assert fp8_line.split()[3:] == ["2.0060", "+0.30%", "700", "0.70x", "slowdown", "matches"]
    assert next(line for line in table if line.startswith("bf16")).endswith("reference")
    assert table[-2] == f"Verdict: {v['summary']}"


def test_seed_replicates_make_one_run_per_seed_and_the_verdict_uses_bf16s_seed_band(api):
    exp = create(api, seed=1, seeds=[3, 1, 2])
    labels = [(r["recipe"], r["seed"], r["label"]) for r in exp["runs"]]
    assert labels[:3] == [("bf16", 1, "bf16 seed=1"), ("bf16", 3, "bf16 seed=3"), ("bf16", 2, "bf16 seed=2")]
    assert [(r["recipe"], r["seed"]) for r in exp["runs"][3:]] == [("fp8_tensorwise", 1), ("nvfp4", 1)]
    b1, b3, b2, fp8, nvfp4 = (r["id"] for r in exp["runs"])
    for run, loss in ((b1, 2.0), (b3, 2.03), (b2, 1.99), (fp8, 2.02), (nvfp4, 2.12)):
        send(api, run, val_and_noisy_train(loss))
        finish(api, run, tokens_per_s=1000.0)
    v = verdict(api, exp["id"])
    assert v["rule"] == "seed_band" and v["reference_run_id"] == b1
    # BF16's deltas 0, +1.5, -0.5 %: mean 1/3, sd 1.041; t(0.975, 2 d.f.) = 4.3027, times sqrt(1 + 1/3) for a
    # one-seed recipe: 1/3 ± 5.171.
    assert v["band_pct"] == pytest.approx([-4.8378, 5.5045], abs=1e-4)
    by = {e["recipe"]: e for e in v["recipes"]}
    # +1.0% is outside a ±0.5% tolerance... but inside what BF16 does by changing its seed; +6% is not.
    assert by["fp8_tensorwise"]["outcome"] == "matches" and by["nvfp4"]["outcome"] == "worse"
    assert by["nvfp4"]["band_pct"] == pytest.approx(v["band_pct"])
    assert "seed band, [-4.84%, +5.50%] for a one-seed recipe (95% t interval from 3 BF16 seeds" in v["summary"]
    ablation = create(api, name="ablation", replicates=2, recipes=["bf16", {"name": "bf16", "bf16_last_layers": 1}])
    # Only the baseline itself is replicated; a BF16 run with layers kept apart is a recipe like any other.
    assert [(r["label"], r["seed"]) for r in ablation["runs"]] == [("bf16 seed=0", 0), ("bf16 seed=1", 1),
                                                                   ("bf16 bf16_last=1", 0)]
    replicated = create(api, name="all", replicates=2, replicate="all")
    assert sorted((r["recipe"], r["seed"]) for r in replicated["runs"]) == sorted(
        (rec, s) for rec in ("bf16", "fp8_tensorwise", "nvfp4") for s in (0, 1))


def test_the_experiments_seed_is_always_one_of_the_replicates(api):
    """`seeds` without `seed`: the first is the experiment's seed; an explicit `seed` missing from `seeds` (or from a
    recipe's seeds) is added first, as the run every comparison pairs with the other recipes."""
    from tests.backend.test_api import EXPERIMENT

    def seeds(body):
        r = api.post("/api/v1/experiments", json={**EXPERIMENT, "enqueue": False, **body})
        assert r.status_code == 201, r.text
        return sorted((run["recipe"], run["seed"]) for run in r.json()["runs"]), r.json()["seed"]

    assert seeds({"seeds": [5, 6], "recipes": ["bf16"]}) == ([("bf16", 5), ("bf16", 6)], 5)
    assert seeds({"seed": 1, "seeds": [5, 6], "recipes": ["bf16"]}) == ([("bf16", 1), ("bf16", 5), ("bf16", 6)], 1)
    assert seeds({"recipes": ["bf16", {"name": "fp8_tensorwise", "seeds": [4]}]}) == (
        [("bf16", 0), ("fp8_tensorwise", 0), ("fp8_tensorwise", 4)], 0)
    # replicates past 2^31 - 1 go on from 0
    assert seeds({"seed": 2**31 - 1, "replicates": 2, "recipes": ["bf16"]}) == ([("bf16", 0), ("bf16", 2**31 - 1)],
                                                                                 2**31 - 1)


@pytest.mark.parametrize("body, fragment", [
    ({"seeds": [0, 0]}, "repeat"),
    ({"seeds": [0, 1], "replicates": 2}, "not both"),
    ({"replicates": 1}, "replicates"),
    ({"verdict_tolerance_pct": 0}, "verdict_tolerance_pct"),
])
def test_bad_seed_and_tolerance_settings_are_refused_with_the_fix(api, body, fragment):
    from tests.backend.test_api import EXPERIMENT

    r = api.post("/api/v1/experiments", json={**EXPERIMENT, **body})
    assert r.status_code == 422 and fragment in r.text, r.text


def task(hash_: str, acc: list[float], n: int | None = None) -> dict:
    return {"kind": "task", "aggregation": {"acc": "mean"}, "higher_is_better": {"acc": True},
            "task_hash": hash_, "n_samples": len(acc) if n is None else n,
            "metrics": {"acc": {"value": sum(acc) / len(acc), "stderr": 0.01}},
            "samples": {"doc_id": list(range(len(acc))), "acc": acc}}


def store_evaluation(database_url, run_id: int, tasks: dict) -> None:
    from backend.db import session_scope
    from backend.schemas import EvalTaskResultIn, EvaluationStatusUpdate
    from backend.services import evaluations

    with session_scope(database_url) as session:
        ev = evaluations.create_evaluation(session, run_id, list(tasks), None)
        for status in ("running", "succeeded"):
            evaluations.update_status(session, ev.id, EvaluationStatusUpdate(status=status))
        for name, result in tasks.items():
            evaluations.store_result(session, ev.id, EvalTaskResultIn(task=name, result=result))


def test_pairing_is_refused_with_409_when_the_task_hashes_or_document_counts_differ(api, database_url):
    exp = create(api)
    bf16, fp8, _ = (r["id"] for r in exp["runs"])
    for run in (bf16, fp8):
        finish(api, run)
        assert api.post(f"/api/v1/runs/{run}/artifacts", json={"kind": "checkpoint", "path": f"/c/{run}"}).status_code == 201
    acc = [1.0, 0.0] * 20
    store_evaluation(database_url, bf16, {"plab_piqa": task("a" * 64, acc)})
    store_evaluation(database_url, fp8, {"plab_piqa": task("b" * 64, acc)})
    r = api.get(f"/api/v1/experiments/{exp['id']}/accuracy")
    assert r.status_code == 409
    assert "task hash aaaaaaaaaaaa… vs bbbbbbbbbbbb…" in r.json()["detail"] and "plab_piqa" in r.json()["detail"]
    # The verdict still answers, with the reason where the accuracy would be.
    assert "cannot be paired" in verdict(api, exp["id"])["accuracy_error"]
    with pytest.raises(ValueError, match="scored 40 documents and the candidate 39"):
        compare_results({"t": task("h", acc)}, {"t": task("h", acc[:-1])})
    with pytest.raises(ValueError, match="only one of the two runs"):
        compare_results({"t": task("h", acc)}, {"t": {**task("h", acc), "samples": {"doc_id": list(range(1, 41)),
                                                                                     "acc": acc}}})
    # Same hash and documents: paired (the cached table of the refused pair is not served again).
    store_evaluation(database_url, fp8, {"plab_piqa": task("a" * 64, acc)})
    table = api.get(f"/api/v1/experiments/{exp['id']}/accuracy").json()
    assert table["n_boot"] == 10_000 and table["correction"] == "holm"
    row = next(r for r in table["runs"] if r["run_id"] == fp8)["vs_bf16"][0]
    assert row["delta"] == 0 and row["p_holm"] == 1.0 and row["significant"] is False
    # The table is kept between requests, but not past a change of what it shows (here a run's label).
    from backend.db import session_scope

    with session_scope(database_url) as session:
        session.execute(text("UPDATE runs SET label = 'renamed' WHERE id = :r"), {"r": fp8})
    table = api.get(f"/api/v1/experiments/{exp['id']}/accuracy").json()
    assert next(r for r in table["runs"] if r["run_id"] == fp8)["label"] == "renamed"


def test_holm_adjustment_matches_a_hand_computation():
    # p sorted: 0.01, 0.02, 0.03, 0.04 (m = 4) -> 4*0.01 = 0.04, 3*0.02 = 0.06, 2*0.03 = 0.06 (monotone: max with
    # 0.06), 1*0.04 = 0.04 -> raised to 0.06. In input order [0.03, 0.01, 0.04, 0.02]:
    assert holm_adjust([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    assert holm_adjust([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm_adjust([]) == []
    with pytest.raises(ValueError, match="p-values"):
        holm_adjust([1.5])


def test_compare_results_corrects_across_tasks_and_keeps_the_uncorrected_p():
    # Three tasks of 200 documents; the candidate gains on the first (clearly), a little on the second.
    base = [0.0] * 100 + [1.0] * 100
    strong = [1.0] * 140 + [1.0] * 60
    weak = [0.0] * 94 + [1.0] * 6 + [1.0] * 100  # 6 discordant pairs: exact p = 2 / 64
    tasks_b = {n: task(n, base) for n in ("t1", "t2", "t3")}
    tasks_c = {"t1": task("t1", strong), "t2": task("t2", weak), "t3": task("t3", base)}
    rows = {r["task"]: r for r in compare_results(tasks_b, tasks_c, method="mcnemar")}
    ps = [rows[t]["p_value"] for t in ("t1", "t2", "t3")]
    assert [rows[t]["p_holm"] for t in ("t1", "t2", "t3")] == pytest.approx(holm_adjust(ps))
    # Hand check of the middle one: p(t2) is the second smallest of three, so p_holm = max(3 p1, 2 p2).
    assert rows["t2"]["p_holm"] == pytest.approx(max(3 * ps[0], 2 * ps[1]))
    assert rows["t2"]["significant_uncorrected"] is True and rows["t2"]["significant"] is False
    assert rows["t1"]["significant"] is True and rows["t1"]["improved"] is True
    assert all(r["family_size"] == 3 for r in rows.values())


def test_the_verdict_says_how_much_held_out_text_its_val_losses_are_measured_on(api):
    exp = create(api)
    bf16, fp8, nvfp4 = (r["id"] for r in exp["runs"])
    spread = {"windows": 32, "tokens": 4096, "rule": "spread", "split_windows": 71, "split_tokens": 9198}
    for run, loss in ((bf16, 2.0), (fp8, 2.006), (nvfp4, 2.05)):
        send(api, run, val_and_noisy_train(loss))
    v = verdict(api, exp["id"])
    assert v["validation"] is None and "held-out tokens" not in v["summary"]  # runs that do not say (yet)
    finish(api, bf16, gemm_backend="bf16", tokens_per_s=1000.0, validation=spread)
    finish(api, fp8, tokens_per_s=700.0, validation=spread)
    finish(api, nvfp4, gemm_backend="emulated", tokens_per_s=500.0, validation={**spread, "rule": "first"})
    v = verdict(api, exp["id"])
    assert v["validation"] == spread
    assert v["summary"].endswith("; val loss over 4,096 held-out tokens (32 windows spread over the split); nvfp4 "
                                 "bf16_last=1 validated on other windows than the reference: not like for like"), v["summary"]
    r = api.patch(f"/api/v1/runs/{nvfp4}", json={"summary": {"validation": spread}})
    assert r.status_code == 200, r.text
    assert verdict(api, exp["id"])["summary"].endswith("(32 windows spread over the split)")


def test_a_run_trained_on_other_tokens_than_the_reference_is_named_not_like_for_like(api):
    """An experiment's runs read data.corpus when each starts: a file added in between gave a later recipe another
    tokenizer and a third more text, and the verdict named it the winner (a review). Their token caches differ; a
    new release's cache format alone (-f<n>) is the same data."""
    exp = create(api)
    bf16, fp8, nvfp4 = (r["id"] for r in exp["runs"])
    for run, loss in ((bf16, 2.0), (fp8, 1.97), (nvfp4, 2.05)):
        send(api, run, val_and_noisy_train(loss))
    finish(api, bf16, gemm_backend="bf16", tokens_per_s=1000.0, data={"cache": "d0de2c39e0a1b2c3d4e5f6a7b8-v512-f2"})
    finish(api, fp8, tokens_per_s=700.0, data={"cache": "d6573e30e0a1b2c3d4e5f6a7b8-v512-f2"})
    finish(api, nvfp4, gemm_backend="emulated", tokens_per_s=500.0,
           data={"cache": "d0de2c39e0a1b2c3d4e5f6a7b8-v512-f3"})
    v = verdict(api, exp["id"])
    assert v["summary"].endswith("; fp8_tensorwise trained on other data than the reference (another token cache: "
                                 "the corpus or the tokenizer changed between the runs): not like for like"), \
        v["summary"]
    r = api.patch(f"/api/v1/runs/{fp8}", json={"summary": {"data": {"cache": "d0de2c39e0a1b2c3d4e5f6a7b8-v512-f2"}}})
    assert r.status_code == 200, r.text
    assert "not like for like" not in verdict(api, exp["id"])["summary"]


def test_the_pure_verdict_without_validation_loss_says_what_is_missing():
    facts = [RunFacts(1, "bf16", "bf16", "succeeded", 0, True, tokens_per_s=10.0),
             RunFacts(2, "mxfp8", "mxfp8", "succeeded", 0, False, tokens_per_s=20.0)]
    v = experiment_verdict(facts, reference_run_id=1)
    assert "needs val/loss" in v["summary"] and v["recipes"][0]["outcome"] is None
    assert v["recipes"][0]["speedup"] == 2.0 and v["recipes"][0]["speed_word"] == "speedup"
    with pytest.raises(ValueError, match="tolerance"):
        experiment_verdict(facts, reference_run_id=1, tolerance_pct=-1)


def test_accuracy_deltas_come_with_bf16s_seed_to_seed_spread(api, database_url):
    exp = create(api, replicates=2)
    b0, b1, fp8, _ = (r["id"] for r in exp["runs"])
    # BF16's seeds close enough for a band (±0.28%) inside the 1% tolerance: a verdict that names a recipe
    for run, loss in ((b0, 2.0), (b1, 2.0005), (fp8, 2.005)):
        send(api, run, val_and_noisy_train(loss))
        finish(api, run)
        assert api.post(f"/api/v1/runs/{run}/artifacts", json={"kind": "checkpoint", "path": f"/c/{run}"}).status_code == 201
    # 40 documents: BF16 seed 0 gets 20 right, seed 1 gets 22 (+5 pp), fp8 gets 19 (-2.5 pp).
    store_evaluation(database_url, b0, {"plab_piqa": task("h" * 64, [1.0] * 20 + [0.0] * 20)})
    store_evaluation(database_url, b1, {"plab_piqa": task("h" * 64, [1.0] * 22 + [0.0] * 18)})
    store_evaluation(database_url, fp8, {"plab_piqa": task("h" * 64, [1.0] * 19 + [0.0] * 21)})
    v = verdict(api, exp["id"])
    assert v["reference_run_id"] == b0 and v["accuracy_error"] is None
    row = next(e for e in v["recipes"] if e["recipe"] == "fp8_tensorwise")["accuracy"][0]
    assert row["delta"] == pytest.approx(-0.025) and row["significant"] is False
    assert row["baseline_seed_spread"] == pytest.approx([0.0, 0.05])
    assert "+0.25% final validation loss, speed not measured, no significant accuracy loss on 1 evaluated task;" \
        in v["summary"]
    facts = [RunFacts(1, "bf16", "bf16", "succeeded", 0, True, 2.0, 2.0, 10.0),
             RunFacts(2, "fp8", "fp8", "succeeded", 0, False, 2.01, 2.0, 15.0, accuracy=(
                 {"task": "piqa", "metric": "acc", "delta": -0.1, "significant": True, "improved": False},
                 {"task": "arc", "metric": "acc", "delta": -0.01, "significant": False, "improved": None}))]
    assert ", but accuracy significantly worse on piqa;" in experiment_verdict(facts, reference_run_id=1)["summary"]
    table = api.get(f"/api/v1/experiments/{exp['id']}/accuracy").json()
    assert table["baseline_run_id"] == b0 and table["seed_replicates"] is True


def test_runs_still_training_are_shown_but_not_judged():
    def facts(base_status, other_status):
        return [RunFacts(1, "bf16", "bf16", base_status, 0, True, 2.0, 2.0, 10.0),
                RunFacts(2, "bf16", "bf16", "running", 1, True, 2.5, 2.5, 10.0),  # an early val loss: no band
                RunFacts(3, "mxfp8", "mxfp8", other_status, 0, False, 2.3, 2.3, 12.0)]
    v = experiment_verdict(facts("succeeded", "running"), reference_run_id=1)
    assert v["rule"] == "tolerance" and v["band_pct"] is None
    assert v["recipes"][0]["outcome"] is None and v["summary"] == "no recipe has finished with a validation loss yet"
    assert v["runs"][2]["val_delta_pct"] == pytest.approx(15.0)  # the table still shows where it is now
    assert experiment_verdict(facts("running", "succeeded"), reference_run_id=1)["summary"] == (
        "BF16 is running: the verdict waits for its final validation loss")
    assert experiment_verdict(facts("succeeded", "succeeded"), reference_run_id=1)["recipes"][0]["outcome"] == "worse"


def test_one_speedup_everywhere_against_bf16s_seeds_on_the_same_device(api):
    """The verdict, its run rows and the comparison endpoint (the throughput chart's labels) give one speedup: a
    run's tokens/s over the mean of the BF16 seeds' on its device; none across two kinds of GPU, with the reason."""
    from tests.backend.test_comparison import comparison

    exp = create(api, seeds=[0, 1])
    b0, b1, fp8, nvfp4 = (r["id"] for r in exp["runs"])
    for run, tps, device in ((b0, 100.0, "NVIDIA H100 80GB HBM3"), (b1, 120.0, "NVIDIA H100 80GB HBM3"),
                             (fp8, 132.0, "NVIDIA H100 80GB HBM3"), (nvfp4, 300.0, "NVIDIA B200")):
        send(api, run, val_and_noisy_train(2.0))
        for body in ({"status": "running", "device_name": device},
                     {"status": "succeeded", "gemm_backend": "real", "summary": {"tokens_per_s": tps}}):
            assert api.post(f"/api/v1/runs/{run}/status", json=body).status_code == 200
    v = verdict(api, exp["id"])
    rows = {r["run_id"]: r for r in v["runs"]}
    cmp = {r["run_id"]: r for r in comparison(api, exp["id"])["runs"]}
    for run, expected in ((b0, 100 / 110), (b1, 120 / 110), (fp8, 1.2)):
        assert rows[run]["speedup"] == pytest.approx(expected) and cmp[run]["speedup"] == pytest.approx(expected)
    assert {e["recipe"]: e["speedup"] for e in v["recipes"]}["fp8_tensorwise"] == pytest.approx(1.2)
    # nvfp4 ran on a B200, BF16 on H100s: no speedup anywhere, and each says why.
    nv = next(e for e in v["recipes"] if e["recipe"] == "nvfp4")
    assert nv["speedup"] is None and rows[nvfp4]["speedup"] is None and cmp[nvfp4]["speedup"] is None
    for note in (nv["speedup_note"], rows[nvfp4]["speedup_note"], cmp[nvfp4]["speedup_note"]):
        assert note.startswith("no baseline run on NVIDIA B200 (it ran on NVIDIA H100 80GB HBM3)")
    assert rows[nvfp4]["device"] == "NVIDIA B200" and cmp[nvfp4]["device_name"] == "NVIDIA B200"


def test_the_lowest_validation_loss_is_compared_with_the_references_own_lowest():
    """Identical curves whose lowest point (2.98) is before the end (3.00): no difference at either point."""
    facts = [RunFacts(1, "bf16", "bf16", "succeeded", 0, True, 3.0, 2.98, 10.0),
             RunFacts(2, "fp8", "fp8", "succeeded", 0, False, 3.0, 2.98, 12.0),
             RunFacts(3, "nvfp4", "nvfp4", "succeeded", 0, False, 3.03, 2.95, 12.0),
             RunFacts(4, "nvfp4", "nvfp4", "succeeded", 1, False, 3.03, 2.97, 12.0)]
    by = {e["recipe"]: e for e in experiment_verdict(facts, reference_run_id=1)["recipes"]}
    assert by["fp8"]["val_delta_pct"] == 0.0 and by["fp8"]["min_val_delta_pct"] == 0.0
    # two seeds: the mean of their lowest points (2.96) against BF16's lowest
    assert by["nvfp4"]["min_val_loss"] == pytest.approx(2.96)
    assert by["nvfp4"]["min_val_delta_pct"] == pytest.approx(100 * (2.96 - 2.98) / 2.98)


def test_a_recorded_bf16_run_is_not_a_seed_of_the_baseline_and_a_renamed_run_stays_its_own_variant(api):
    """A record-only (external) BF16 run logged by someone's script joined BF16's seeds and turned the tolerance
    rule into a seed band 70 points wide; a run renamed to another run's label merged into that variant."""
    exp = create(api)
    bf16, fp8, nvfp4 = (r["id"] for r in exp["runs"])
    for run, loss in ((bf16, 3.0), (fp8, 3.02), (nvfp4, 3.6)):
        send(api, run, val_and_noisy_train(loss))
        finish(api, run, tokens_per_s=1000.0)
    r = api.post("/api/v1/runs", json={"experiment_id": exp["id"], "recipe": "bf16", "label": "my bf16"})
    assert r.status_code == 201, r.text
    mine = r.json()["id"]
    send(api, mine, val_and_noisy_train(3.10))
    assert api.post(f"/api/v1/runs/{mine}/status", json={"status": "succeeded"}).status_code == 200
    v = verdict(api, exp["id"])
    assert v["rule"] == "tolerance" and v["reference_run_id"] == bf16 and v["baseline"]["run_ids"] == [bf16]
    by = {e["variant"]: e for e in v["recipes"]}
    assert by["my bf16"]["run_ids"] == [mine] and by["my bf16"]["outcome"] == "worse"  # compared like a recipe
    assert by["nvfp4 bf16_last=1"]["outcome"] == "worse"
    # nvfp4 renamed to fp8's label: still two variants, each with its own numbers; the names stay unique
    assert api.patch(f"/api/v1/runs/{nvfp4}", json={"label": "fp8_tensorwise"}).status_code == 200
    v = verdict(api, exp["id"])
    entries = {tuple(e["run_ids"]): e for e in v["recipes"]}
    assert entries[(fp8,)]["variant"] == "fp8_tensorwise" and entries[(fp8,)]["outcome"] == "matches"
    assert entries[(nvfp4,)]["variant"] == f"fp8_tensorwise (run {nvfp4})" and entries[(nvfp4,)]["outcome"] == "worse"


def test_a_seed_run_twice_is_one_sample_of_bf16s_spread():
    """Two BF16 runs of seed 0 and one of seed 1: the band comes from two seeds (none with fewer than two)."""
    def facts(seeds):
        runs = [RunFacts(i + 1, "bf16", "bf16", "succeeded", s, True, 3.0 + 0.01 * i) for i, s in enumerate(seeds)]
        return runs + [RunFacts(9, "fp8", "fp8", "succeeded", 0, False, 3.0)]

    assert experiment_verdict(facts([0, 0]), reference_run_id=1)["rule"] == "tolerance"
    twice = experiment_verdict(facts([0, 0, 1]), reference_run_id=1)
    assert twice["rule"] == "seed_band" and "from 2 BF16 seeds" in twice["rule_text"]
    # the reference (seed 0, 3.00) and seed 1's run (3.02); seed 0's second run (3.01) is left out
    assert twice["band_pct"] == pytest.approx(seed_band([0.0, 100 * 0.02 / 3.0]))
