"""Run page, metric explorer, full-range export, states, housekeeping, phone layout and the emulated hatch."""
from __future__ import annotations

import base64
import csv
import io
import json
import re
import tarfile

import pytest

from training.gemm import run_gemm_benchmark

pytestmark = pytest.mark.browser

TRACEBACK = ('Traceback (most recent call last):\n  File "train.py", line 10, in step\n    loss.backward()\n'
             "RuntimeError: CUDA error: an illegal memory access was encountered")


def _report(recipe: str, blocks: int = 2) -> dict:
    layers = []
    for b in range(blocks):
        for name, (i, o) in (("self_attn.q_proj", (64, 64)), ("mlp.down_proj", (128, 64))):
            kept = recipe == "bf16" or b == blocks - 1
            layers.append({"name": f"layers.{b}.{name}", "block": b, "in_features": i, "out_features": o,
                           "converted": not kept, "backend": "bf16" if kept else "emulated",
                           "reason": ("bf16 baseline: high-precision GEMM" if recipe == "bf16" else
                                      f"kept in BF16: block {b} is among the last bf16_last_layers=1") if kept else ""})
    return {"recipe": recipe, "gemm_backend": "bf16" if recipe == "bf16" else "emulated", "device": "cpu",
            "layers": layers, "notes": [] if recipe == "bf16" else ["emulated: no MXFP8 tensor cores on cpu"]}


@pytest.fixture(scope="module")
def finished(server):
    """A BF16 run and an mxfp8 run (last block kept in BF16, emulated), both finished, with loss, grad norm and
    learning-rate curves, a conversion report, and a checkpoint folder for mxfp8; plus a failed fp8 run."""
    exp = server.create_experiment(["bf16", {"name": "mxfp8", "bf16_last_layers": 1}, "fp8_tensorwise"],
                                   name="pages", steps=120, description="**Goal**: check *mxfp8*\n\n- one\n- two")
    runs = {r["recipe"]: r for r in exp["runs"]}
    for i, recipe in enumerate(("bf16", "mxfp8")):
        run_id = runs[recipe]["id"]
        server.set_status(run_id, "running", device_name="cpu (test)")
        server.log_loss_curve(run_id, steps=120, start=4.0, offset_pct=0.5 * i, val_every=40,
                              tokens_per_s=1000.0 - 200 * i)
        r = server.http.post(f"/api/v1/runs/{run_id}/metrics", json={"points": [
            p for s in range(120) for p in (
                {"key": "train/grad_norm", "step": s, "value": 2.0 / (1 + s / 30) + 0.3 * ((s * 7919) % 13) / 13 + i,
                 "tokens": (s + 1) * 128},
                {"key": "train/lr", "step": s, "value": 3e-3 * min(1, (s + 1) / 20), "tokens": (s + 1) * 128})]})
        assert r.status_code == 200, r.text
        patch = server.http.patch(f"/api/v1/runs/{run_id}", json={"conversion_report": _report(recipe)})
        assert patch.status_code == 200, patch.text
        server.set_status(run_id, "succeeded", gemm_backend="bf16" if recipe == "bf16" else "emulated",
                          summary={"tokens_per_s": 1000.0 - 200 * i, "final_loss": 1.6 + 0.01 * i,
                                   "peak_mem_gib": 1.0, "mfu": 0.3})
    mx = runs["mxfp8"]["id"]
    ckpt = server.home / "runs" / str(mx) / "checkpoints" / "step_00000120"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text('{"hidden_size": 64}')
    (ckpt / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    r = server.http.post(f"/api/v1/runs/{mx}/artifacts", json={"kind": "checkpoint", "step": 120,
                                                               "path": f"runs/{mx}/checkpoints/step_00000120"})
    assert r.status_code == 201, r.text
    fp8 = runs["fp8_tensorwise"]["id"]
    server.set_status(fp8, "running")
    server.set_status(fp8, "failed", error_message=TRACEBACK)
    return exp, runs


def test_run_page_shows_spec_diff_conversion_report_errors_and_a_downloadable_checkpoint(server, page, finished):
    exp, runs = finished
    page.goto(f"{server.base_url}/runs/{runs['mxfp8']['id']}")
    page.locator("#run-spec-diff tbody tr[data-field]").first.wait_for()
    diff = {page.locator("#run-spec-diff tr[data-field]").nth(i).get_attribute("data-field"):
            page.locator("#run-spec-diff tr[data-field]").nth(i).inner_text()
            for i in range(page.locator("#run-spec-diff tr[data-field]").count())}
    # Exactly what differs from the BF16 run: the recipe and the BF16 blocks kept (defaults are equal on both).
    assert set(diff) == {"recipe", "bf16_last_layers"}
    assert '"bf16"' in diff["recipe"] and '"mxfp8"' in diff["recipe"] and "0" in diff["bf16_last_layers"]
    full = json.loads(page.locator("#run-spec").text_content())
    assert full["training"]["steps"] == 120 and "lr" in full["training"]  # every default filled in

    summary = page.locator("#conversion-summary").inner_text()
    assert "2 of 4" in summary and "emulated" in summary
    assert "2 kept in BF16: block 1 is among the last bf16_last_layers=1" in page.locator(
        "#conversion-report .kept-reasons").inner_text()
    assert page.locator("#conversion-layers tbody tr.converted").count() == 2

    link = page.locator("a.checkpoint-download")
    assert link.count() == 1
    with page.expect_download() as info:
        link.click()
    data = open(info.value.path(), "rb").read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert sorted(tar.getnames()) == ["step_00000120/config.json", "step_00000120/model.safetensors"]
        assert tar.extractfile("step_00000120/model.safetensors").read() == bytes(range(256)) * 40

    # Every logged metric has its chart (numerics none here), the smoothed curve over the faint raw one.
    page.wait_for_function("() => ['train/loss', 'train/grad_norm', 'train/lr', 'val/loss', 'perf/tokens_per_s']"
                           ".every(k => document.querySelector(`[data-key='${k}'] .main-svg`))")
    # each y axis says its unit; an emulated run's speed says it is no speed claim
    axis = {k: page.evaluate(f"() => document.querySelector(\"[data-key='{k}']\").layout.yaxis.title.text")
            for k in ("train/loss", "val/loss", "perf/tokens_per_s", "train/lr")}
    assert axis == {"train/loss": "nats/token", "val/loss": "nats/token", "train/lr": "learning rate",
                    "perf/tokens_per_s": "tokens/s - emulated GEMMs, not a speed claim"}
    events = page.locator("#run-events").inner_text()
    assert "started" in events and "checkpoint at step 120" in events and "succeeded" in events
    assert page.console_log.errors == []

    # A failed run: the traceback folded, its last line (the exception) shown.
    page.goto(f"{server.base_url}/runs/{runs['fp8_tensorwise']['id']}")
    details = page.locator("#run-errors details.traceback")
    details.wait_for()
    assert details.get_attribute("open") is None
    assert "RuntimeError: CUDA error" in details.locator("summary").inner_text()
    assert not page.locator("#run-errors pre").is_visible()
    assert page.console_log.errors == []


def test_metric_explorer_overlays_grad_norm_of_two_runs_with_the_raw_curve_behind(server, page, charts, finished):
    exp, runs = finished
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    # Shown by default: grad norm and learning rate, one series per run that logged them.
    charts.wait_for_traces("explore-train_grad_norm", 2)
    charts.wait_for_traces("explore-train_lr", 2)
    traces = page.evaluate("() => document.getElementById('explore-train_grad_norm').data.map(t => ({name: t.name, "
                           "raw: !!t.meta.raw, opacity: t.opacity, n: t.y.length, run: t.meta.run_id, y: t.y}))")
    raw = [t for t in traces if t["raw"]]
    smooth = [t for t in traces if not t["raw"]]
    assert {t["run"] for t in smooth} == {runs["bf16"]["id"], runs["mxfp8"]["id"]}
    assert len(raw) == 2 and all(t["opacity"] < 0.5 for t in raw) and all(t["n"] == 120 for t in traces)
    assert raw[0]["y"] != smooth[0]["y"]  # smoothing is on by default
    assert page.locator("#smoothing").input_value() == "0.6"

    # Any other logged key can be added; the shared x-axis control switches every explorer chart.
    page.select_option("#explorer-key", "perf/tokens_per_s")
    charts.wait_for_traces("explore-perf_tokens_per_s", 2)
    page.select_option("#x-axis", "tokens")
    page.wait_for_function("() => document.getElementById('explore-train_grad_norm').layout.xaxis.title.text === 'tokens'")
    assert charts.traces("explore-train_grad_norm")[0]["x"][:2] == [128, 256]
    # A run of another experiment can be overlaid by id.
    other = server.create_experiment(["bf16"], name="other")
    server.http.post(f"/api/v1/runs/{other['runs'][0]['id']}/metrics", json={"points": [
        {"key": "train/grad_norm", "step": s, "value": 1.0, "tokens": (s + 1) * 128} for s in range(30)]})
    page.fill("#explorer-run-id", str(other["runs"][0]["id"]))
    page.click("#explorer-add")
    charts.wait_for_traces("explore-train_grad_norm", 3)
    # No chart offers Plotly's cloud upload ("Edit in Chart Studio").
    assert page.locator(".modebar-btn[data-title*='Chart Studio'], .modebar-btn[data-title*='Cloud']").count() == 0
    assert page.locator(".modebar-btn").count() > 0  # the mode bars are there, without those buttons
    assert page.console_log.errors == []
    # A run id that does not exist is said next to the form, and stays said past the page's next poll.
    page.fill("#explorer-run-id", "999999")
    page.click("#explorer-add")
    error = page.locator("#explorer-error")
    error.wait_for(state="visible")
    assert "Run 999999 could not be added" in error.inner_text() and "does not exist" in error.inner_text()
    page.wait_for_timeout(2500)
    assert error.is_visible()
    charts.wait_for_traces("explore-train_grad_norm", 3)  # the runs already shown stay


def test_export_holds_the_full_range_after_a_zoom(server, page, charts, finished):
    exp, runs = finished
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("loss-chart", 3)
    page.evaluate("() => Plotly.relayout('loss-chart', {'xaxis.range': [20, 40]})")
    page.wait_for_function("() => document.getElementById('loss-chart').data.find(t => t.meta.raw).x.length === 21")

    with page.expect_download() as info:
        page.click("#export-menu summary")
        page.click("#export-csv")
    rows = list(csv.DictReader(open(info.value.path(), newline="")))
    stored = 2 * (120 + 120 + 120 + 120 + 3)  # loss, tokens/s, grad norm, lr and 3 val points per finished run
    assert len(rows) == stored
    assert {int(r["step"]) for r in rows if r["key"] == "train/loss"} == set(range(120))

    with page.expect_download() as info:
        page.click("#export-json")
    data = json.load(open(info.value.path()))
    assert sum(len(s["step"]) for r in data["runs"] for s in r["series"].values()) == stored

    with page.expect_download() as info:
        page.click("#export-html")
    report = open(info.value.path(), encoding="utf-8").read()
    figures = json.loads(re.search(r"const FIGURES = (.*);\nfor", report).group(1).replace("\\u003c", "<"))
    ids = [f["id"] for f in figures]
    for panel in ("loss-chart", "relative-chart", "throughput-chart", "memory-chart", "explore-train_grad_norm"):
        assert panel in ids
    loss = next(f for f in figures if f["id"] == "loss-chart")
    assert loss["layout"]["xaxis"]["autorange"] is True and "range" not in loss["layout"]["xaxis"]
    assert all(len(t["x"]) == 120 for t in loss["data"] if t["x"])  # not the zoomed 21 points
    assert 'id="report-verdict"' in report and "runs-table" in report
    assert page.console_log.errors == []


def test_states_failed_record_only_and_queued_without_a_worker(server, page, finished):
    exp, runs = finished
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    status = page.locator("#live-status")
    page.wait_for_function("() => document.getElementById('live-status').dataset.state === 'done'")
    assert "failed" in status.inner_text() and status.get_attribute("data-polling") == "false"

    queued = server.create_experiment(["bf16"], name="queued-no-worker")
    page.goto(f"{server.base_url}/experiments/{queued['id']}")
    page.wait_for_function("() => /no worker/.test(document.getElementById('live-status').textContent)")
    assert "plab worker" in status.inner_text()

    # A record-only run: marked, no Cancel, not polled.
    rec = server.http.post("/api/v1/runs", json={"experiment_id": queued["id"], "recipe": "fp8_tensorwise"}).json()
    server.set_status(queued["runs"][0]["id"], "running")
    server.set_status(queued["runs"][0]["id"], "succeeded")
    page.goto(f"{server.base_url}/experiments/{queued['id']}")
    row = page.locator(f"#runs-table tr[data-run-id='{rec['id']}']")
    row.locator(".badge.record-only").wait_for()
    assert row.locator("button.cancel-run").count() == 0
    # The template's own data-polling="false" holds before the script's first poll: wait for the state the
    # script writes once it has drawn the runs and the worker note.
    page.wait_for_function("() => document.getElementById('live-status').dataset.state === 'done'")
    assert "record-only" in status.inner_text() and status.get_attribute("data-polling") == "false"
    # Panels with nothing to show are one line. The numerics panel collapses after its own request, which the
    # live-status line does not wait for (a suite run saw it still open right after 'done'): wait for it.
    page.locator("#numerics-panel.collapsed .empty-note").wait_for(state="visible", timeout=15_000)
    assert page.console_log.errors == []


def test_tags_notes_archive_and_delete_from_the_pages(server, page, finished):
    exp = server.create_experiment(["bf16"], name="housekeeping-ui")
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    page.click("#hk-edit")
    page.fill("#hk-tags-input", "sweep-7, h100")
    page.fill("#hk-notes-input", "**lr** too high <b>x</b>")
    page.click("#hk-save")
    page.locator("#hk-tags .tag").nth(1).wait_for()
    assert page.locator("#hk-notes strong").inner_text() == "lr"
    assert "<b>x</b>" in page.locator("#hk-notes").inner_text()  # raw HTML stays text
    assert server.http.get(f"/api/v1/experiments/{exp['id']}").json()["tags"] == ["sweep-7", "h100"]

    page.goto(f"{server.base_url}/?tag=sweep-7")
    page.locator(f"tr[data-experiment-id='{exp['id']}']").wait_for()
    assert page.locator("#experiments-body tr[data-experiment-id]").count() == 1

    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    page.click("#hk-archive")
    page.locator("#hk-archived").wait_for()
    page.goto(f"{server.base_url}/")
    page.locator("#experiments-body tr[data-experiment-id]").first.wait_for()
    assert page.locator(f"tr[data-experiment-id='{exp['id']}']").count() == 0
    page.check("#search-archived")
    page.locator(f"tr[data-experiment-id='{exp['id']}']").wait_for()

    server.http.post(f"/api/v1/runs/{exp['runs'][0]['id']}/cancel")
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    page.once("dialog", lambda d: d.dismiss())
    page.click("#hk-delete")
    assert server.http.get(f"/api/v1/experiments/{exp['id']}").status_code == 200
    page.once("dialog", lambda d: d.accept())
    page.click("#hk-delete")
    page.wait_for_url(f"{server.base_url}/")
    assert server.http.get(f"/api/v1/experiments/{exp['id']}").status_code == 404
    assert page.console_log.errors == []


def test_every_page_fits_a_390_px_screen(server, browser, finished, api_token):
    exp, runs = finished
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    context.request.post(f"{server.base_url}/api/v1/session", headers={"Authorization": f"Bearer {api_token}"})
    pg = context.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        for path, ready in (("/", "#experiments-body tr[data-experiment-id]"), ("/runs", "#runs-list-body tr[data-run-id]"),
                            ("/experiments/new", "#recipes-fieldset"),
                            (f"/experiments/{exp['id']}", "#loss-chart .main-svg"),
                            (f"/runs/{runs['mxfp8']['id']}", "#run-metrics .main-svg"),
                            ("/experiments/987654", "#not-found")):
            pg.goto(server.base_url + path)
            pg.wait_for_selector(ready)
            pg.wait_for_timeout(500)  # charts resize to the screen
            width = pg.evaluate("() => ({doc: document.documentElement.scrollWidth, body: document.body.scrollWidth, "
                                "view: window.innerWidth})")
            assert width["doc"] <= width["view"] and width["body"] <= width["view"], (path, width)
            pg.screenshot(path=f"test-artifacts/browser/phone_{path.strip('/').replace('/', '_') or 'home'}.png",
                          full_page=True)
    finally:
        context.close()
    assert errors == []


# ------------------------------------------------------------------------------------------ the emulated hatch
COUNT_PIXELS = """async (b64) => {
  const img = new Image();
  img.src = 'data:image/png;base64,' + b64;
  await img.decode();
  const c = document.createElement('canvas');
  c.width = img.width; c.height = img.height;
  const ctx = c.getContext('2d');
  ctx.drawImage(img, 0, 0);
  const d = ctx.getImageData(0, 0, c.width, c.height).data;
  let colored = 0, white = 0;
  for (let i = 0; i < d.length; i += 4) {
    if (d[i] > 220 && d[i + 1] > 220 && d[i + 2] > 220) white += 1; else colored += 1;
  }
  return {colored: colored / (d.length / 4), white: white / (d.length / 4)};
}"""


def _biggest(locator):
    """The element of `locator` with the largest drawn area (the tallest bar of a trace)."""
    areas = locator.evaluate_all("els => els.map(e => { const b = e.getBoundingClientRect(); return b.width * b.height; })")
    return locator.nth(max(range(len(areas)), key=areas.__getitem__))


def _pixels(page, blank, locator, name: str) -> dict:
    locator.scroll_into_view_if_needed()
    box = locator.bounding_box()
    assert box and box["width"] >= 4 and box["height"] >= 4, box
    clip = {"x": box["x"] + 1, "y": box["y"] + 1, "width": box["width"] - 2, "height": box["height"] - 2}
    png = page.screenshot(clip=clip, path=f"test-artifacts/browser/hatch_{name.replace(' ', '_')}.png")
    return blank.evaluate(COUNT_PIXELS, base64.b64encode(png).decode())


def test_emulated_bars_and_their_legend_entries_have_visible_hatched_pixels(server, page, charts, finished):
    exp, runs = finished
    result = run_gemm_benchmark(model="tiny", micro_batch=2, seq_len=16, vocab_size=256,
                                formats=["bf16", "fp8_tensorwise", "nvfp4"], device="cpu", repeats=1, warmup=0,
                                compile_quant=False)
    # Bars of a known height (CPU timings of a tiny model are noise: a bar may be 2 px tall), so the test is
    # about drawing, not about this machine's speed.
    for rec in result["results"]:
        if rec["format"] != "bf16" and rec.get("speedup_vs_bf16") is not None:
            rec["speedup_vs_bf16"] = 1.5
    r = server.http.post("/api/v1/gemm-benchmarks", json={"result": result, "experiment_id": exp["id"], "name": "hatch"})
    assert r.status_code == 201, r.text
    blank = page.context.new_page()
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("gemm-chart-kernel", 2)
    charts.wait_for_traces("throughput-chart", 1)
    page.wait_for_timeout(800)  # plotly's transitions settle
    checks = {
        # The emulated (nvfp4) trace is the second of the GEMM chart; its tallest bar and its legend swatch.
        "gemm bar": _biggest(page.locator("#gemm-chart-kernel .trace.bars").nth(1).locator(".point path")),
        "gemm legend": page.locator("#gemm-chart-kernel .legend .traces").nth(1).locator(".legendpoints path").first,
        # The throughput chart's mxfp8 bar (one trace, one bar per run: bf16, mxfp8, fp8).
        "throughput bar": page.locator("#throughput-chart .trace.bars path").nth(1),
    }
    for what, locator in checks.items():
        seen = _pixels(page, blank, locator, what)
        # The bar's colour fills most of it, and the white hatch shows through: both visible.
        assert seen["colored"] > 0.3 and seen["white"] > 0.05, (what, seen)
    assert page.console_log.errors == []


def test_a_failed_run_is_retried_from_its_page_and_a_diverged_one_offers_no_retry(server, page):
    exp = server.create_experiment(["fp8_tensorwise"], name="retry-ui")
    failed, diverged = (run["id"] for run in exp["runs"])
    server.set_status(failed, "running")
    server.set_status(failed, "failed", error_message="RuntimeError: CUDA out of memory")
    server.set_status(diverged, "running")
    server.set_status(diverged, "diverged", diverged_step=7)
    page.goto(f"{server.base_url}/runs/{diverged}")
    page.locator("#run-status .badge").wait_for()
    assert page.locator("#run-retry").is_hidden() and page.locator("#run-cancel").is_hidden()

    page.goto(f"{server.base_url}/runs/{failed}")
    page.locator("#run-retry").wait_for(state="visible")
    assert page.locator("#run-errors-panel").is_visible() and page.locator("#run-cancel").is_hidden()
    page.once("dialog", lambda d: d.dismiss())
    page.click("#run-retry")
    assert server.http.get(f"/api/v1/runs/{failed}").json()["status"] == "failed"
    page.once("dialog", lambda d: d.accept())
    page.click("#run-retry")
    page.locator("#run-retry").wait_for(state="hidden")
    page.wait_for_function("() => /queued/.test(document.getElementById('run-status').textContent)")
    run = server.http.get(f"/api/v1/runs/{failed}").json()
    assert run["status"] == "queued" and run["error_message"] is None
    assert page.locator("#run-cancel").is_visible() and page.locator("#run-errors-panel").is_hidden()
    assert page.console_log.errors == []


def test_the_run_page_says_each_evaluations_limit_as_documents_or_a_share_of_them(server, page):
    exp = server.create_experiment(["fp8_tensorwise"], name="eval-limits")
    rid = exp["runs"][0]["id"]
    server.set_status(rid, "running")
    server.set_status(rid, "succeeded")
    r = server.http.post(f"/api/v1/runs/{rid}/artifacts", json={"kind": "checkpoint", "path": "/ckpt/final", "step": 1})
    assert r.status_code == 201, r.text
    for limit in (0.125, 20, None):
        r = server.http.post(f"/api/v1/runs/{rid}/evaluations", json={"tasks": ["plab_piqa"], "limit": limit})
        assert r.status_code == 201, r.text
    evaluations = server.http.get(f"/api/v1/runs/{rid}/evaluations").json()
    assert sorted(e["limit"] for e in evaluations if e["limit"]) == [0.125, 20], evaluations
    page.goto(f"{server.base_url}/runs/{rid}")
    page.locator("#run-evaluations tbody tr[data-evaluation-id]").nth(len(evaluations) - 1).wait_for()
    rows = {int(page.locator("#run-evaluations tbody tr[data-evaluation-id]").nth(i)
                .get_attribute("data-evaluation-id")):
            page.locator("#run-evaluations tbody tr[data-evaluation-id]").nth(i).locator("td").nth(1).inner_text()
            for i in range(len(evaluations))}
    said = {e["limit"]: rows[e["id"]] for e in evaluations}
    assert said == {0.125: "plab_piqa (12.5% of each task's documents)", 20: "plab_piqa (20 documents per task)",
                    None: "plab_piqa"}, said
    assert page.console_log.errors == []
