"""The experiment page's GEMM panel draws the experiment's GEMM benchmark as the API holds it: speedup bars per
layer × pass × format in both modes, the shapes table, emulated formats labelled, and the predicted end-to-end
speedup next to the one the experiment's training runs measured."""
from __future__ import annotations

import pytest

from training.gemm import run_gemm_benchmark

pytestmark = pytest.mark.browser

# A small Llama (GQA) so that the real benchmark of every GEMM of its training step takes a second on the CPU.
DIMS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256}


@pytest.fixture(scope="module")
def cpu_result() -> dict:
    # bf16_step_time_s: a BF16 step far longer than its GEMMs, so the prediction is an Amdahl one.
    return run_gemm_benchmark(DIMS, micro_batch=1, seq_len=32, formats=["bf16", "fp8_tensorwise", "nvfp4"],
                              device="cpu", repeats=1, warmup=0, compile_quant=False, bf16_step_time_s=5.0)


def finished_experiment(server, name: str) -> dict:
    exp = server.create_experiment(["bf16", "fp8_tensorwise"], name=name)
    for run in exp["runs"]:
        tps = 1000.0 if run["recipe"] == "bf16" else 1500.0
        server.set_status(run["id"], "running", device_name="cpu (test)")
        server.set_status(run["id"], "succeeded", gemm_backend="bf16" if run["recipe"] == "bf16" else "real",
                          summary={"tokens_per_s": tps, "final_loss": 1.6})
    return exp


def post_benchmark(server, body: dict) -> dict:
    r = server.http.post("/api/v1/gemm-benchmarks", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def test_panel_draws_speedup_bars_shapes_and_predicted_next_to_measured_speedup(server, page, charts, cpu_result):
    exp = finished_experiment(server, "gemm-panel")
    bench = post_benchmark(server, {"result": cpu_result, "experiment_id": exp["id"], "name": "tiny on cpu"})
    stored = bench["result"]

    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("gemm-chart-kernel", 2)
    charts.wait_for_traces("gemm-chart-quant", 2)
    assert page.locator("#gemm-panel").is_visible()

    # One bar group per layer × pass, one bar per low-precision format; the heights are the API's speedups.
    for mode in ("kernel", "quant"):
        traces = charts.traces(f"gemm-chart-{mode}")
        assert [t["name"] for t in traces] == ["fp8_tensorwise", "nvfp4 (emulated – no hardware support)"]
        assert traces[0]["x"][:3] == ["qkv.fprop", "qkv.dgrad", "qkv.wgrad"] and len(traces[0]["x"]) == 15
        expected = {(r["layer"], r["gemm"]): r["speedup_vs_bf16"] for r in stored["results"]
                    if r["format"] == "nvfp4" and r["mode"] == mode}
        drawn = dict(zip(traces[1]["x"], traces[1]["y"]))
        assert drawn == {f"{layer}.{gemm}": v for (layer, gemm), v in expected.items()}
    patterns = page.evaluate("() => document.getElementById('gemm-chart-kernel').data.map(t => t.marker.pattern.shape)")
    assert patterns == ["", "/"]  # the emulated format is hatched

    rows = page.locator("#gemm-shapes-table tbody tr")
    assert rows.count() == 15
    first = rows.first
    assert first.get_attribute("data-layer") == "qkv" and first.get_attribute("data-gemm") == "fprop"
    # QKV of a GQA model: (4 + 2·2) heads × 16 = 128 wide, over 32 tokens.
    assert "32 × 64 × 128" in first.inner_text()
    assert page.locator("#gemm-shapes-table td.emulated[data-format='nvfp4']").count() == 30
    assert page.locator("#gemm-shapes-table td.emulated[data-format='fp8_tensorwise']").count() == 0
    assert "emulated – no hardware support" in page.locator("#gemm-emulated-note").inner_text()
    assert "CPU timings" in page.locator("#gemm-device").inner_text()

    fp8 = page.locator("#gemm-prediction-table tr[data-format='fp8_tensorwise']")
    predicted = stored["prediction"]["quant"]["fp8_tensorwise"]
    assert predicted["basis"] == "amdahl"
    assert f"{predicted['speedup']:.2f}×" in fp8.locator("td.predicted").inner_text()
    assert "Amdahl" in fp8.locator("td.predicted").inner_text()
    assert fp8.locator("td.measured").inner_text().strip() == "1.50×"  # 1500 / 1000 tokens/s
    # No nvfp4 run in this experiment: nothing measured to show.
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
    # No finished training run: no measured column.
    assert page.locator("#gemm-measured-head").is_hidden()
    assert page.console_log.errors == []
