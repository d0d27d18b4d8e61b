"""The experiment page's GEMM panel draws the experiment's GEMM benchmark as the API holds it: speedup bars per
layer × pass × format in both modes, the shapes table, emulated formats labelled, and the predicted end-to-end
speedup next to the one the experiment's training runs measured."""
from __future__ import annotations

import re

import pytest

from training.gemm import run_gemm_benchmark

pytestmark = pytest.mark.browser

# The model of the experiments `server.create_experiment` makes (tiny preset, vocabulary 512, 4 sequences of 32
# tokens per step), so the benchmark describes their training step; every GEMM of it takes milliseconds on a CPU.
BENCH = dict(model="tiny", micro_batch=4, seq_len=32, vocab_size=512, formats=["bf16", "fp8_tensorwise", "nvfp4"],
             device="cpu", repeats=1, warmup=0, compile_quant=False)


@pytest.fixture(scope="module")
def cpu_result() -> dict:
    return run_gemm_benchmark(**BENCH)


def finished_experiment(server, name: str, *, bf16_step_s: float, device_name: str) -> dict:
    exp = server.create_experiment(["bf16", "fp8_tensorwise"], name=name)
    for run in exp["runs"]:
        tps = 1000.0 if run["recipe"] == "bf16" else 1500.0
        server.set_status(run["id"], "running", device_name=device_name)
        server.set_status(run["id"], "succeeded", gemm_backend="bf16" if run["recipe"] == "bf16" else "real",
                          summary={"tokens_per_s": tps, "final_loss": 1.6, "step_time_s": bf16_step_s})
    return exp


def post_benchmark(server, body: dict) -> dict:
    r = server.http.post("/api/v1/gemm-benchmarks", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def test_panel_draws_speedup_bars_shapes_and_predicted_next_to_measured_speedup(server, page, charts, cpu_result):
    # The BF16 run's step: ten times its GEMMs, on the benchmark's device (a prediction needs both on one machine).
    bf16_gemm_s = cpu_result["totals"]["quant"]["bf16"]["total_s"]
    exp = finished_experiment(server, "gemm-panel", bf16_step_s=10 * bf16_gemm_s,
                              device_name=cpu_result["device"]["name"])
    bench = post_benchmark(server, {"result": cpu_result, "experiment_id": exp["id"], "name": "tiny on cpu"})
    stored = bench["result"]

    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("gemm-chart-kernel", 2)
    charts.wait_for_traces("gemm-chart-quant", 2)
    assert page.locator("#gemm-panel").is_visible()

    # One bar group per layer × pass, one bar per low-precision format; the heights are the API's speedups.
    for mode in ("kernel", "quant"):
        traces = charts.traces(f"gemm-chart-{mode}")
        # On a CPU neither has hardware: FP8 runs torch's CPU kernel, NVFP4 the emulation; each says which.
        assert [t["name"] for t in traces] == ["fp8_tensorwise (CPU kernel – no FP8 hardware)",
                                               "nvfp4 (emulated – no hardware support)"]
        assert traces[0]["x"][:3] == ["qkv.fprop", "qkv.dgrad", "qkv.wgrad"] and len(traces[0]["x"]) == 15
        expected = {(r["layer"], r["gemm"]): r["speedup_vs_bf16"] for r in stored["results"]
                    if r["format"] == "nvfp4" and r["mode"] == mode}
        drawn = dict(zip(traces[1]["x"], traces[1]["y"]))
        assert drawn == {f"{layer}.{gemm}": v for (layer, gemm), v in expected.items()}
    patterns = page.evaluate("() => document.getElementById('gemm-chart-kernel').data.map(t => t.marker.pattern.shape)")
    assert patterns == ["/", "/"]  # both hatched

    rows = page.locator("#gemm-shapes-table tbody tr")
    assert rows.count() == 15
    first = rows.first
    assert first.get_attribute("data-layer") == "qkv" and first.get_attribute("data-gemm") == "fprop"
    qkv = next(x for x in stored["shapes"] if x["layer"] == "qkv" and x["gemm"] == "fprop")
    assert qkv["m"] == 4 * 32 and f"{qkv['m']} × {qkv['k']} × {qkv['n']}" in first.inner_text()
    assert page.locator("#gemm-shapes-table td.emulated[data-format='nvfp4']").count() == 30
    assert page.locator("#gemm-shapes-table td.emulated[data-format='fp8_tensorwise']").count() == 30
    note = page.locator("#gemm-emulated-note").inner_text()
    assert "fp8_tensorwise: CPU kernel – no FP8 hardware" in note and "nvfp4: emulated – no hardware support" in note
    assert "CPU timings" in page.locator("#gemm-device").inner_text()

    fp8 = page.locator("#gemm-prediction-table tr[data-format='fp8_tensorwise']")
    # The benchmark had no step time (GEMM-only); the experiment's BF16 run supplies it: Amdahl on its step.
    assert stored["prediction"]["quant"]["fp8_tensorwise"]["basis"] == "GEMM-only"
    # The panel predicts from the GEMMs training runs (LM head in BF16 for every recipe) when the result has them.
    def training_total(t):
        return (t.get("training") or {}).get("total_s", t["total_s"])

    step = 10 * bf16_gemm_s
    fp8_gemm_s = training_total(stored["totals"]["quant"]["fp8_tensorwise"])
    expected = step / (step - training_total(stored["totals"]["quant"]["bf16"]) + fp8_gemm_s)
    predicted = fp8.locator("td.predicted").inner_text()
    assert "Amdahl with the BF16 run's step time, GEMM 10.0%" in predicted, predicted
    shown = float(re.search(r"([0-9.]+)×", predicted).group(1))
    assert abs(shown - expected) <= 0.0051, (shown, expected)  # two decimals; JS and Python may round an edge apart
    assert fp8.locator("td.measured").inner_text().strip() == "1.50×"  # 1500 / 1000 tokens/s
    # No nvfp4 run in this experiment: nothing measured to show.
    assert page.locator("#gemm-prediction-table tr[data-format='nvfp4'] td.measured").inner_text().strip() == "–"
    assert page.console_log.errors == []


def test_the_measured_speedup_is_against_bf16_on_the_benchmarks_device(server, page, charts, cpu_result):
    """A BF16 seed that ran on another GPU is not what a recipe's measured speedup on the benchmark's device is
    against (the first finished BF16 run was, at 500 tokens/s: 3.00x); nor is a recipe's run on another device shown."""
    device = cpu_result["device"]["name"]
    exp = server.create_experiment(["bf16", "fp8_tensorwise", "nvfp4"], name="gemm-devices", seeds=[0, 1])
    placed = {("bf16", 0): (500.0, "another GPU"), ("bf16", 1): (1000.0, device),
              ("fp8_tensorwise", 0): (1500.0, device), ("nvfp4", 0): (4000.0, "another GPU")}
    for run in exp["runs"]:
        tps, where = placed[(run["recipe"], run["seed"])]
        server.set_status(run["id"], "running", device_name=where)
        server.set_status(run["id"], "succeeded", gemm_backend="bf16" if run["recipe"] == "bf16" else "real",
                          summary={"tokens_per_s": tps, "final_loss": 1.6, "step_time_s": 1.0})
    post_benchmark(server, {"result": cpu_result, "experiment_id": exp["id"], "name": "tiny on cpu"})
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("gemm-chart-kernel", 2)
    fp8 = page.locator("#gemm-prediction-table tr[data-format='fp8_tensorwise'] td.measured")
    fp8.wait_for()
    assert fp8.inner_text().strip() == "1.50×"   # 1500 / 1000, BF16's run on the benchmark's device
    assert page.locator("#gemm-prediction-table tr[data-format='nvfp4'] td.measured").inner_text().strip() == "–"
    assert page.console_log.errors == []


def test_no_panel_without_a_benchmark_and_a_queued_one_appears_when_a_worker_finishes_it(server, page, charts,
                                                                                          cpu_result):
    exp = server.create_experiment(["bf16"], name="gemm-live")
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    page.wait_for_function("() => window.plabGemm && window.plabGemm.refreshes > 0")
    assert page.locator("#gemm-panel").is_hidden()

    exp = server.create_experiment(["bf16"], name="gemm-queued")
    queued = post_benchmark(server, {"request": cpu_result["request"], "experiment_id": exp["id"], "enqueue": False})
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    page.locator("#gemm-meta .badge.status-queued").wait_for()
    assert page.locator("#gemm-result").is_hidden()

    # What the Celery task reports, through the worker-facing endpoint: the page polls and draws it.
    for body in ({"status": "running"}, {"status": "succeeded", "result": cpu_result}):
        r = server.http.post(f"/api/v1/gemm-benchmarks/{queued['id']}/status", json=body)
        assert r.status_code == 200, r.text
    charts.wait_for_traces("gemm-chart-kernel", 2, timeout=20_000)
    assert page.locator("#gemm-meta .badge.status-succeeded").count() == 1
    # No finished training run: no measured column, and the prediction stays the GEMM-only upper bound.
    assert page.locator("#gemm-measured-head").is_hidden()
    predicted = page.locator("#gemm-prediction-table tr[data-format='fp8_tensorwise'] td.predicted").inner_text()
    assert "upper bound" in predicted and "no finished BF16 run" in predicted
    assert page.console_log.errors == []
