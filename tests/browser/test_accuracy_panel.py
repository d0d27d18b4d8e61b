"""The experiment page's accuracy panel shows what /experiments/{id}/accuracy computes: per task and recipe the
main metric with its stderr, each recipe's paired difference to BF16 with its 95% interval and a significance
marker coloured by whether the recipe got better, emulated runs labelled, and a bar chart of the differences with
their intervals. Results reach the server the way the evaluation worker posts them (status, per-task results)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "browser"

N_DOCS = 200
BF16_RIGHT = 120  # documents 0..119 right: accuracy 0.60


def piqa_entry(right: set[int]) -> dict:
    """A task entry as training.evaluation.evaluate_checkpoint reports it (0/1 accuracy per document)."""
    acc = [1.0 if d in right else 0.0 for d in range(N_DOCS)]
    p = sum(acc) / N_DOCS
    return {"kind": "task", "group": None,
            "metrics": {"acc": {"value": p, "stderr": math.sqrt(p * (1 - p) / (N_DOCS - 1))},
                        "acc_norm": {"value": p, "stderr": math.sqrt(p * (1 - p) / (N_DOCS - 1))}},
            "aggregation": {"acc": "mean", "acc_norm": "mean"},
            "higher_is_better": {"acc": True, "acc_norm": True},
            "n_samples": N_DOCS, "n_docs": 1838, "version": 1.0, "task_hash": "0" * 64, "time_s": 3.2,
            "samples": {"doc_id": list(range(N_DOCS)), "acc": acc, "acc_norm": acc}}


def heldout_entry(extra_nats_per_doc: float) -> dict:
    """Bits per byte of held-out text: per document [log-likelihood, bytes]; `extra_nats_per_doc` makes it worse."""
    pairs = [[-(50.0 + (d % 7)) - extra_nats_per_doc, 40.0 + (d % 5)] for d in range(60)]
    bpb = -sum(ll for ll, _ in pairs) / sum(w for _, w in pairs) / math.log(2)
    return {"kind": "task", "group": None,
            "metrics": {"bits_per_byte": {"value": bpb, "stderr": None},
                        "byte_perplexity": {"value": 2 ** bpb, "stderr": None}},
            "aggregation": {"bits_per_byte": "bits_per_byte", "byte_perplexity": "weighted_perplexity"},
            "higher_is_better": {"bits_per_byte": False, "byte_perplexity": False},
            "n_samples": 60, "n_docs": 60, "version": 0, "task_hash": "1" * 64, "time_s": 1.1,
            "samples": {"doc_id": list(range(60)), "bits_per_byte": pairs, "byte_perplexity": pairs}}


def finished_runs(server, name: str, recipes: list[str], backends: dict[str, str]) -> dict:
    """An experiment whose runs trained (as a worker reports it) and left a checkpoint to evaluate."""
    exp = server.create_experiment(recipes, name=name)
    for run in exp["runs"]:
        server.set_status(run["id"], "running", device_name="cpu (test)")
        server.set_status(run["id"], "succeeded", gemm_backend=backends[run["recipe"]], summary={"final_loss": 1.6})
        r = server.http.post(f"/api/v1/runs/{run['id']}/artifacts", json={"kind": "checkpoint", "path": "/tmp/x"})
        assert r.status_code == 201, r.text
    return exp


def start_evaluation(server, run_id: int, tasks: list[str]) -> dict:
    # Enqueued to the embedded broker, where no worker picks it up: the test plays the worker below.
    r = server.http.post(f"/api/v1/runs/{run_id}/evaluations", json={"tasks": tasks, "limit": N_DOCS})
    assert r.status_code == 201, r.text
    return r.json()


def worker_posts(server, evaluation_id: int, results: dict[str, dict], *, start: bool = True,
                 finish: bool = True) -> None:
    """What an evaluation's job posts: `running` (its claim: once per job), each task's result, `succeeded`."""
    if start:
        r = server.http.post(f"/api/v1/evaluations/{evaluation_id}/status", json={"status": "running"})
        assert r.status_code == 200, r.text
    for task, result in results.items():
        r = server.http.post(f"/api/v1/evaluations/{evaluation_id}/results", json={"task": task, "result": result})
        assert r.status_code == 201, r.text
    if finish:
        r = server.http.post(f"/api/v1/evaluations/{evaluation_id}/status",
                             json={"status": "succeeded", "lm_eval_version": "0.4.13"})
        assert r.status_code == 200, r.text


def test_table_and_delta_chart_show_each_recipe_against_bf16_with_significance(server, page, charts):
    recipes = ["bf16", "fp8_tensorwise", "mxfp8"]
    exp = finished_runs(server, "accuracy-panel", recipes,
                        {"bf16": "bf16", "fp8_tensorwise": "real", "mxfp8": "emulated"})
    run_of = {r["recipe"]: r["id"] for r in exp["runs"]}
    tasks = ["plab_piqa", "plab_heldout_bpb"]
    bf16_right = set(range(BF16_RIGHT))
    # fp8 gets 20 more documents right (+10 pp, every discordant pair in its favour) but is 1 nat per document
    # worse on held-out text; mxfp8 answers exactly as BF16 does.
    results = {
        "bf16": {"plab_piqa": piqa_entry(bf16_right), "plab_heldout_bpb": heldout_entry(0.0)},
        "fp8_tensorwise": {"plab_piqa": piqa_entry(bf16_right | set(range(150, 170))),
                           "plab_heldout_bpb": heldout_entry(1.0)},
        "mxfp8": {"plab_piqa": piqa_entry(bf16_right), "plab_heldout_bpb": heldout_entry(0.0)},
    }
    evals = {recipe: start_evaluation(server, run_of[recipe], tasks) for recipe in recipes}
    for recipe in ("bf16", "mxfp8"):
        worker_posts(server, evals[recipe]["id"], results[recipe])
    # fp8's evaluation is still running when the page opens: the panel polls and picks up its results.
    worker_posts(server, evals["fp8_tensorwise"]["id"], {}, finish=False)

    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    page.locator("#accuracy-status .badge.status-running").wait_for()
    assert page.locator("#accuracy-status").get_attribute("data-live") == "true"
    worker_posts(server, evals["fp8_tensorwise"]["id"], results["fp8_tensorwise"], start=False)
    charts.wait_for_traces("accuracy-delta-chart", 2, timeout=20_000)
    page.wait_for_function("() => document.getElementById('accuracy-status').dataset.live === 'false'")

    # Columns: BF16 (the reference) first, then every evaluated recipe; the emulated one says so.
    heads = page.locator("#accuracy-table thead th[data-recipe]")
    assert [heads.nth(i).get_attribute("data-recipe") for i in range(heads.count())] == recipes
    emulated_head = page.locator("#accuracy-table th[data-recipe='mxfp8']")
    assert emulated_head.get_attribute("data-emulated") == "true" and "emulated GEMMs" in emulated_head.text_content()

    # Rows: each task's main metric, value ± stderr, and the paired delta with its interval.
    piqa = page.locator("#accuracy-table tr[data-task='plab_piqa']")
    assert piqa.get_attribute("data-metric") == "acc"
    bf16_cell = piqa.locator(f"td[data-run-id='{run_of['bf16']}']").inner_text()
    assert "60.0%" in bf16_cell and "± 3.5" in bf16_cell and "Δ" not in bf16_cell
    fp8_cell = piqa.locator(f"td[data-run-id='{run_of['fp8_tensorwise']}']")
    assert "70.0%" in fp8_cell.inner_text() and "Δ +10.0 pp" in fp8_cell.inner_text()
    assert fp8_cell.locator(".acc-marker").inner_text() == "▲"
    assert fp8_cell.locator(".acc-marker").get_attribute("class").split() == ["acc-marker", "acc-better"]
    same = piqa.locator(f"td[data-run-id='{run_of['mxfp8']}']")
    assert "Δ ±0.0 pp [0.0, 0.0]" in same.inner_text() and same.locator(".acc-marker").inner_text() == "n.s."

    bpb = page.locator("#accuracy-table tr[data-task='plab_heldout_bpb']")
    assert bpb.get_attribute("data-metric") == "bits_per_byte" and "↓ better" in bpb.inner_text()
    worse = bpb.locator(f"td[data-run-id='{run_of['fp8_tensorwise']}'] .acc-marker")
    # Bits per byte went up, which is worse: an up-arrow in the "worse" colour.
    assert worse.inner_text() == "▲" and "acc-worse" in worse.get_attribute("class")

    # The chart: one trace per non-BF16 recipe, the accuracy Δ in points (as the table) with the interval as
    # error bars; bits per byte in its own unit.
    traces = charts.traces("accuracy-delta-chart", "t => ({name: t.name, x: t.x, y: t.y, "
                                                   "plus: t.error_y.array, minus: t.error_y.arrayminus, "
                                                   "hatch: t.marker.pattern.shape})")
    assert [t["name"] for t in traces] == ["fp8_tensorwise", "mxfp8 (emulated GEMMs)"]
    assert [t["hatch"] for t in traces] == ["", "/"]
    fp8, mx = traces
    assert fp8["x"] == tasks
    assert fp8["y"][0] == pytest.approx(10.0)
    assert fp8["y"][1] > 0
    assert fp8["plus"][0] > 0 and fp8["minus"][0] > 0  # the bootstrap interval has width around +10 pp
    assert fp8["y"][0] - fp8["minus"][0] > 0  # ... and excludes 0, as the table's ▲ says
    assert mx["y"] == [0, 0] and mx["plus"] == [0, 0]

    note = page.locator("#accuracy-panel").inner_text()
    assert "paired percentile bootstrap over documents" in note
    assert "LM head and the embeddings" in note and "BF16" in note
    assert page.console_log.errors == []
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator("#accuracy-panel").screenshot(path=str(ARTIFACTS / "accuracy-panel.png"))


def test_mcnemar_method_recomputes_the_table(server, page, charts):
    exp = finished_runs(server, "accuracy-mcnemar", ["bf16", "fp8_rowwise"], {"bf16": "bf16", "fp8_rowwise": "real"})
    run_of = {r["recipe"]: r["id"] for r in exp["runs"]}
    right = set(range(BF16_RIGHT))
    for recipe, entry in (("bf16", piqa_entry(right)), ("fp8_rowwise", piqa_entry(right - {0, 1, 2}))):
        ev = start_evaluation(server, run_of[recipe], ["plab_piqa"])
        worker_posts(server, ev["id"], {"plab_piqa": entry})

    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("accuracy-delta-chart", 1)
    page.select_option("#accuracy-method", "mcnemar")
    page.wait_for_function("() => window.plabAccuracy.table && window.plabAccuracy.table.method === 'mcnemar'")
    cell = page.locator(f"#accuracy-table tr[data-task='plab_piqa'] td[data-run-id='{run_of['fp8_rowwise']}']")
    # 3 discordant documents, all against fp8: exact two-sided p = 0.25, not significant.
    assert "Δ −1.5 pp" in cell.inner_text() and cell.locator(".acc-marker").inner_text() == "n.s."
    assert "mcnemar" in cell.locator(".acc-delta").get_attribute("title")
    assert "McNemar" in page.locator("#accuracy-method-note").inner_text()
    assert page.console_log.errors == []


def test_panel_explains_how_to_evaluate_when_no_evaluation_exists(server, page):
    exp = finished_runs(server, "accuracy-empty", ["bf16"], {"bf16": "bf16"})
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    page.wait_for_function("() => window.plabAccuracy && window.plabAccuracy.refreshes > 0")
    assert page.locator("#accuracy-empty").is_visible()
    assert "plab eval RUN_ID" in page.locator("#accuracy-empty").inner_text()
    assert page.locator("#accuracy-result").is_hidden()
    assert page.evaluate("() => window.plabAccuracy.accuracyLoads") == 0
    assert page.console_log.errors == []


def test_failed_evaluation_shows_the_workers_error_and_unpaired_tasks_show_no_delta(server, page):
    exp = finished_runs(server, "accuracy-failed", ["bf16", "nvfp4"], {"bf16": "bf16", "nvfp4": "emulated"})
    run_of = {r["recipe"]: r["id"] for r in exp["runs"]}
    # A group's entry carries its subtasks' names, not per-document results: with no subtask stored there is
    # nothing to pair, so the table shows the values but no delta.
    blimp = {"kind": "group", "group": None, "subtasks": ["plab_blimp_anaphor_gender_agreement"],
             "metrics": {"acc": {"value": 0.71, "stderr": 0.01}}, "aggregation": {"acc": "mean"},
             "higher_is_better": {"acc": True}, "n_samples": 100, "n_docs": 1000, "task_hash": "2" * 64}
    for recipe in ("bf16", "nvfp4"):
        ev = start_evaluation(server, run_of[recipe], ["plab_blimp"])
        worker_posts(server, ev["id"], {"plab_blimp": blimp})
    broken = start_evaluation(server, run_of["nvfp4"], ["plab_piqa"])
    worker_posts(server, broken["id"], {}, finish=False)
    r = server.http.post(f"/api/v1/evaluations/{broken['id']}/status",
                         json={"status": "failed", "error_message": "EvaluationError: no checkpoint at /tmp/x\n\ntb"})
    assert r.status_code == 200, r.text

    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    page.locator("#accuracy-table tr[data-task='plab_blimp']").wait_for()
    assert "no checkpoint at /tmp/x" in page.locator("#accuracy-error").inner_text()
    cell = page.locator(f"#accuracy-table tr[data-task='plab_blimp'] td[data-run-id='{run_of['nvfp4']}']")
    assert "71.0%" in cell.inner_text() and "Δ –" in cell.inner_text()
    assert page.locator("#accuracy-delta-chart").is_hidden()  # no paired difference to draw
    assert page.locator("#accuracy-status").get_attribute("data-live") == "false"
    assert page.console_log.errors == []
