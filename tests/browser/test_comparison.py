"""The comparison views of the experiment page: relative loss to BF16, x-axis switch, smoothing, log scale,
throughput bars, and the offline HTML export."""
from __future__ import annotations

import json
import math
import random
import statistics

import pytest

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def compared(server):
    """bf16, fp8_tensorwise 0.5% above it on the same token grid, mxfp8 2% above it logged on a coarser
    token grid (the alignment on tokens must interpolate it onto BF16's points), and nvfp4 still queued."""
    exp = server.create_experiment(["bf16", "fp8_tensorwise", "mxfp8", "nvfp4"], name="compare")
    runs = {r["recipe"]: r for r in exp["runs"]}
    server.log_loss_curve(runs["bf16"]["id"], steps=80, start=3.0, tokens_per_step=128, tokens_per_s=1000.0)
    server.log_loss_curve(runs["fp8_tensorwise"]["id"], steps=80, start=3.0, offset_pct=0.5, tokens_per_step=128,
                          tokens_per_s=1400.0)
    server.log_loss_curve(runs["mxfp8"]["id"], steps=40, start=3.0, offset_pct=2.0, tokens_per_step=256,
                          tokens_per_s=900.0)
    # Numerics of mxfp8: layer i underflows a fraction (i + 1) / 100 at step s / 1000 more each sample.
    server.http.post(f"/api/v1/runs/{runs['mxfp8']['id']}/metrics", json={"points": [
        {"key": f"numerics/model.layers.{i}.mlp.down_proj/{stat}", "step": step,
         "value": (i + 1) / 100 + step / 1000 if stat == "underflow_frac" else 0.0}
        for i in range(3) for step in (0, 10, 20) for stat in ("underflow_frac", "saturation_frac")]})
    for recipe, backend in (("bf16", "bf16"), ("fp8_tensorwise", "real"), ("mxfp8", "emulated")):
        server.set_status(runs[recipe]["id"], "running")
        server.set_status(runs[recipe]["id"], "succeeded", gemm_backend=backend)
    return exp, runs


def test_relative_difference_to_bf16_is_the_known_offset_aligned_on_tokens(server, page, charts, compared):
    exp, runs = compared
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    # One trace per non-baseline run; the queued nvfp4 run has no points yet but keeps its legend slot.
    charts.wait_for_traces("relative-chart", 3)
    traces = {t["name"]: t for t in charts.traces("relative-chart")}
    assert set(traces) == {"fp8_tensorwise", "mxfp8", "nvfp4"}

    same_grid = traces["fp8_tensorwise"]
    assert len(same_grid["y"]) == 80
    assert all(abs(v - 0.5) < 1e-9 for v in same_grid["y"])
    # x is BF16's own token positions.
    assert same_grid["x"] == [(s + 1) * 128 for s in range(80)]

    # mxfp8 was logged every 256 tokens: interpolated onto BF16's grid (within mxfp8's range only), its
    # difference stays near the planted 2% (linear interpolation of a convex curve overestimates slightly).
    coarse = traces["mxfp8"]
    assert coarse["x"][0] == 256 and coarse["x"][-1] == 40 * 256
    assert len(coarse["x"]) == 40 * 2 - 1
    assert all(1.99 < v < 2.2 for v in coarse["y"])
    assert traces["nvfp4"]["y"] == []

    band = page.evaluate("() => document.getElementById('relative-chart').layout.shapes[0]")
    assert (band["y0"], band["y1"]) == (-1, 1)
    label = page.evaluate("() => document.getElementById('relative-chart').layout.annotations.map(a => a.text)")
    assert label == ["±1%: the verdict's tolerance, on final validation loss"]
    assert page.console_log.errors == []


def test_long_noisy_runs_are_compared_on_the_apis_bucket_means(server, page, charts):
    """Runs longer than the page's 1000 points come back downsampled to each bucket's min and max point; the
    difference of two runs' extremes is their step-to-step noise, not their offset. The chart draws the API's
    comparison instead (bucket means at mean tokens, the verdict's numbers): the same values, and near the
    planted 0.5% where the min/max points are spread over several percent."""
    exp = server.create_experiment(["bf16", "fp8_tensorwise"], name="noisy-long")
    runs = {r["recipe"]: r for r in exp["runs"]}
    rng = random.Random(7)
    for recipe, offset in (("bf16", 0.0), ("fp8_tensorwise", 0.5)):
        points = [{"key": "train/loss", "step": step, "tokens": (step + 1) * 128,
                   "value": (3.0 * math.exp(-step / 8000) + 1.5) * (1 + offset / 100) * (1 + rng.gauss(0, 0.02))}
                  for step in range(16_000)]
        for i in range(0, len(points), 8000):
            r = server.http.post(f"/api/v1/runs/{runs[recipe]['id']}/metrics", json={"points": points[i:i + 8000]})
            assert r.status_code in (200, 201), r.text
        server.set_status(runs[recipe]["id"], "running")
        server.set_status(runs[recipe]["id"], "succeeded", gemm_backend="real" if offset else "bf16")
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    page.fill("#smoothing", "0")
    page.dispatch_event("#smoothing", "input")
    charts.wait_for_traces("relative-chart", 1)
    drawn = charts.traces("relative-chart")[0]
    api = server.http.get(f"/api/v1/experiments/{exp['id']}/comparison",
                          params={"x": "tokens", "max_points": 1000}).json()
    entry = next(e for e in api["runs"] if e["recipe"] == "fp8_tensorwise")
    assert drawn["name"] == "fp8_tensorwise" and 100 < len(drawn["x"]) <= 1000
    assert drawn["x"] == pytest.approx(entry["x"]) and drawn["y"] == pytest.approx(entry["delta_pct"])
    # Buckets of 16 steps: the mean's difference has 2% x sqrt(2) / 4 = 0.71% noise around the offset.
    assert abs(statistics.fmean(drawn["y"]) - 0.5) < 0.1 and statistics.pstdev(drawn["y"]) < 0.9
    # What the page's own loss series hold (buckets of 32 steps, their min and max point): the same difference
    # computed from them is spread over several percent.
    series = server.http.get(f"/api/v1/experiments/{exp['id']}/series",
                             params={"keys": "train/loss", "max_points": 1000, "x": "tokens"}).json()
    by_run = {s["run_id"]: s["series"]["train/loss"] for s in series["runs"]}
    base, fp8 = by_run[runs["bf16"]["id"]], by_run[runs["fp8_tensorwise"]["id"]]
    assert base["downsampled"] and fp8["downsampled"]
    extremes = [100 * (f - b) / b for f, b in zip(fp8["value"], base["value"])]
    assert statistics.pstdev(extremes) > 3 * statistics.pstdev(drawn["y"])
    assert page.console_log.errors == []


def test_relative_difference_function_on_synthetic_series(server, page):
    page.goto(f"{server.base_url}/experiments/new")
    result = page.evaluate("""async () => {
        const s = await import('/static/js/series.js');
        const base = {x: [0, 10, 20, 30], y: [4, 3, 2, 1]};
        // Same line 10% higher, sampled at other x: interpolation on a line is exact.
        const other = {x: [5, 15, 25, 35], y: [3.85, 2.75, 1.65, 0.55]};
        return {diff: s.relativeDifference(base, other), ema0: s.ema([1, 2, 3], 0), ema: s.ema([2, 2, 2], 0.9)};
    }""")
    assert result["diff"]["x"] == [10, 20, 30]
    assert result["diff"]["y"] == pytest.approx([10.0, 10.0, 10.0])
    assert result["ema0"] == [1, 2, 3]
    # Bias-corrected EMA of a constant is the constant from the first point on.
    assert result["ema"] == pytest.approx([2, 2, 2])


def test_x_axis_switch_smoothing_and_log_scale_redraw_the_loss_chart(server, page, charts, compared):
    exp, runs = compared
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("loss-chart", 4)
    title = "() => document.getElementById('loss-chart').layout.xaxis.title.text"
    assert page.evaluate(title) == "step"
    assert charts.traces("loss-chart")[0]["x"][:3] == [0, 1, 2]

    page.select_option("#x-axis", "tokens")
    page.wait_for_function(f"() => ({title})() === 'tokens'")
    bf16 = charts.traces("loss-chart")[0]
    assert bf16["name"] == "bf16" and bf16["x"][:3] == [128, 256, 384]

    page.select_option("#x-axis", "wall_time")
    page.wait_for_function(f"() => ({title})().startsWith('wall time')")
    assert charts.traces("loss-chart")[0]["x"][:2] == pytest.approx([0.0, 0.05])

    raw = charts.traces("loss-chart")[0]["y"]
    page.fill("#smoothing", "0.9")
    page.dispatch_event("#smoothing", "input")
    smoothed = charts.traces("loss-chart")[0]["y"]
    assert smoothed[0] == pytest.approx(raw[0])
    assert smoothed[10] > raw[10]  # a decaying curve: the EMA lags above it

    # The relative difference is smoothed after alignment, so a constant offset stays exactly constant
    # and runs on different token grids do not drift apart through different EMA lags.
    rel = {t["name"]: t["y"] for t in charts.traces("relative-chart")}
    assert rel["fp8_tensorwise"] == pytest.approx([0.5] * 80)
    assert all(1.99 < v < 2.2 for v in rel["mxfp8"])

    page.check("#log-scale")
    assert page.evaluate("() => document.getElementById('loss-chart').layout.yaxis.type") == "log"
    assert page.console_log.errors == []


def test_throughput_bars_show_speedup_over_bf16_and_mark_emulated_runs(server, page, charts, compared):
    exp, runs = compared
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("throughput-chart", 1)
    # These runs sent no final summary: their tokens/s come from the logged perf series, fetched after
    # the loss curves are drawn.
    page.wait_for_function("() => document.getElementById('throughput-chart').data[0].y[0] === 1000")
    bars = page.evaluate("() => { const t = document.getElementById('throughput-chart').data[0];"
                         " return {x: t.x, y: t.y, text: t.text, pattern: t.marker.pattern.shape}; }")
    assert bars["x"] == ["bf16", "fp8_tensorwise", "mxfp8 (emulated)", "nvfp4"]
    assert bars["y"][:3] == [1000.0, 1400.0, 900.0]
    assert bars["text"][:3] == ["1.00×", "1.40×", "0.90×"]
    assert bars["pattern"] == ["", "", "/", ""]
    assert page.locator(f"#runs-table tr[data-run-id='{runs['mxfp8']['id']}'] .gemm-emulated").count() == 1
    # No run reported an MFU (as on a CPU): neither the memory/MFU chart nor the paragraph on how MFU is computed.
    assert page.locator("#memory-chart").is_hidden() and page.locator("#mfu-convention").is_hidden()
    assert page.console_log.errors == []


def test_exported_html_report_opens_offline_and_shows_the_charts(server, page, charts, compared, browser,
                                                                 tmp_path):
    exp, runs = compared
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("relative-chart", 3)
    page.click("#export-menu summary")
    # The report fetches Plotly (~3.5 MB) and every run's full loss series first: 15 s was not always enough with
    # four test workers on two cores.
    with page.expect_download(timeout=60_000) as info:
        page.click("#export-html")
    report = tmp_path / "report.html"
    info.value.save_as(report)
    html = report.read_text()
    assert "http://" not in html.split("<script>", 1)[0]  # no external stylesheet or script before plotly

    offline = browser.new_context(offline=True)
    try:
        view = offline.new_page()
        errors = []
        view.on("pageerror", lambda e: errors.append(str(e)))
        view.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        view.goto(report.as_uri())
        # The page's charts with something to show: no peak memory or MFU was reported, so no memory chart.
        view.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 3")
        assert view.locator("#memory-chart").count() == 0
        counts = view.evaluate("() => ['loss-chart', 'relative-chart', 'throughput-chart']"
                               ".map(id => document.getElementById(id).data.filter(t => !(t.meta && t.meta.raw)).length)")
        assert counts == [4, 3, 1]
        assert view.locator("#runs-table tr").count() == 1 + 4
        assert view.locator("#report-verdict").count() == 1
        assert errors == []
    finally:
        offline.close()


def test_csv_and_json_exports_hold_every_stored_point(server, page, charts, compared, tmp_path):
    exp, runs = compared
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("loss-chart", 4)
    page.click("#export-menu summary")
    # The report fetches Plotly (~3.5 MB) and every run's full loss series first: 15 s was not always enough with
    # four test workers on two cores.
    with page.expect_download(timeout=60_000) as info:
        page.click("#export-csv")
    path = tmp_path / "e.csv"
    info.value.save_as(path)
    lines = path.read_text().splitlines()
    assert lines[0] == "run_id,recipe,label,key,step,tokens,wall_time,value,gemm_backend"
    # Every key, not only the curves on screen: train/loss and perf/tokens_per_s of three runs, 18 numerics points.
    assert len(lines) == 1 + 2 * (80 + 80 + 40) + 18
    assert any(line.startswith(f"{runs['bf16']['id']},bf16,bf16,train/loss,0,128,1800000000.0,") for line in lines)
    # Each row says whether its run's GEMMs were real or emulated (the queued nvfp4 run has not said yet).
    backends = {line.split(",")[0]: line.rsplit(",", 1)[1] for line in lines[1:]}
    assert backends == {str(runs["bf16"]["id"]): "bf16", str(runs["fp8_tensorwise"]["id"]): "real",
                        str(runs["mxfp8"]["id"]): "emulated"}

    with page.expect_download() as info:
        page.click("#export-json")
    info.value.save_as(tmp_path / "e.json")
    exported = json.loads((tmp_path / "e.json").read_text())
    assert exported["experiment_id"] == exp["id"]
    assert [len(r["series"].get("train/loss", {}).get("value", [])) for r in exported["runs"]] == [80, 80, 40, 0]
    assert [r["gemm_backend"] for r in exported["runs"]] == ["bf16", "real", "emulated", None]


def test_numerics_heatmap_shows_layers_by_sampled_steps(server, page, charts, compared):
    exp, runs = compared
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("loss-chart", 4)
    page.select_option("#numerics-run", str(runs["mxfp8"]["id"]))
    page.wait_for_function("() => { const d = document.getElementById('numerics-chart').data;"
                           " return d && d[0].y.length === 3; }")
    heat = page.evaluate("() => { const t = document.getElementById('numerics-chart').data[0];"
                         " return {x: t.x, y: t.y, z: t.z}; }")
    assert heat["y"] == [f"model.layers.{i}.mlp.down_proj" for i in range(3)]
    assert heat["x"] == [0, 10, 20]
    assert heat["z"] == [[pytest.approx((i + 1) / 100 + s / 1000) for s in (0, 10, 20)] for i in range(3)]

    page.select_option("#numerics-stat", "saturation_frac")
    page.wait_for_function("() => document.getElementById('numerics-chart').data[0].z.flat().every(v => v === 0)")
    assert page.console_log.errors == []


def test_zooming_the_loss_chart_requeries_the_server_for_that_window(server, page, charts, compared):
    exp, runs = compared
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("loss-chart", 4)
    with page.expect_request(lambda r: "/series?" in r.url and "x_min=20" in r.url and "x_max=40" in r.url):
        page.evaluate("() => Plotly.relayout('loss-chart', {'xaxis.range': [20, 40]})")
    page.wait_for_function("() => document.getElementById('loss-chart').data[0].x.length === 21")
    assert charts.traces("loss-chart")[0]["x"] == list(range(20, 41))

    # Back to the full range: the whole series again.
    page.evaluate("() => Plotly.relayout('loss-chart', {'xaxis.autorange': true})")
    page.wait_for_function("() => document.getElementById('loss-chart').data[0].x.length === 80")
    assert page.console_log.errors == []
