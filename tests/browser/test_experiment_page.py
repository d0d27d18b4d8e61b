"""The experiment page draws what the API holds: one loss trace per run, the runs table, live polling."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser


def test_experiment_page_draws_one_loss_trace_per_run_and_no_console_errors(server, page, charts):
    exp = server.create_experiment(["bf16", "fp8_tensorwise", "mxfp8"], name="three-recipes")
    runs = {r["recipe"]: r for r in exp["runs"]}
    assert len(runs) == 3
    for i, (recipe, run) in enumerate(sorted(runs.items())):
        server.set_status(run["id"], "running", device_name="cpu (test)")
        server.log_loss_curve(run["id"], steps=60, start=4.0, offset_pct=0.5 * i, val_every=20,
                              tokens_per_s=1000.0 * (1 + i))
        server.set_status(run["id"], "succeeded", gemm_backend="emulated" if recipe == "mxfp8" else "bf16",
                          summary={"tokens_per_s": 1000.0 * (1 + i), "final_loss": 1.6 + i * 0.01})

    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("loss-chart", 3)
    assert charts.trace_count("loss-chart") == 3
    names = [t["name"] for t in charts.traces("loss-chart")]
    assert sorted(names) == sorted(r["label"] for r in runs.values())
    assert [len(t["y"]) for t in charts.traces("loss-chart")] == [60, 60, 60]
    # Validation loss is present, so its chart shows, again one trace per run.
    charts.wait_for_traces("val-loss-chart", 3)

    rows = page.locator("#runs-table tbody tr[data-run-id]")
    assert rows.count() == 3
    assert page.locator("#runs-table .badge.status-succeeded").count() == 3
    assert page.locator("#runs-table .gemm-emulated").count() == 1
    # All runs are final: the page must stop polling (the state the script writes, not the template's default).
    page.wait_for_function("() => document.getElementById('live-status').dataset.state === 'done'")
    assert page.locator("#live-status").get_attribute("data-polling") == "false"
    assert page.console_log.errors == []


def test_live_run_updates_without_reload_and_can_be_cancelled(server, page, charts):
    exp = server.create_experiment(["bf16", "fp8_rowwise"], name="live")
    base, other = sorted(exp["runs"], key=lambda r: r["recipe"] != "bf16")
    server.set_status(base["id"], "running", device_name="cpu (test)")
    server.log_loss_curve(base["id"], steps=10, start=4.0)

    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("loss-chart", 2)
    # The status line follows the charts (it waits for the worker registry's answer on queued runs).
    page.wait_for_selector("#live-status[data-polling='true']", timeout=8000)
    assert page.evaluate("() => document.getElementById('loss-chart').data[0].y.length") == 10

    # New points arrive while the page is open: the next poll (every ~2 s) draws them.
    server.log_loss_curve(base["id"], steps=30, start=4.0)
    page.wait_for_function("() => document.getElementById('loss-chart').data[0].y.length === 30", timeout=8000)

    # The queued run offers a cancel button that goes through the API, after a confirmation: declined, nothing.
    cancel = page.locator(f"#runs-table tr[data-run-id='{other['id']}'] button.cancel-run")
    page.once("dialog", lambda d: d.dismiss())
    cancel.click()
    assert server.http.get(f"/api/v1/runs/{other['id']}").json()["status"] == "queued"
    page.on("dialog", lambda d: d.accept())
    cancel.click()
    page.wait_for_selector(f"#runs-table tr[data-run-id='{other['id']}'][data-status='cancelled']", timeout=8000)
    assert server.http.get(f"/api/v1/runs/{other['id']}").json()["status"] == "cancelled"

    # A running run cannot stop at once: the page says so until the worker reports `cancelled`.
    page.locator(f"#runs-table tr[data-run-id='{base['id']}'] button.cancel-run").click()
    page.wait_for_selector(f"#runs-table tr[data-run-id='{base['id']}'] .cancelling", timeout=8000)
    assert server.http.get(f"/api/v1/runs/{base['id']}").json()["cancel_requested"] is True
    server.set_status(base["id"], "cancelled")
    page.wait_for_selector("#live-status[data-polling='false']", timeout=8000)
    assert page.locator(f"#runs-table tr[data-run-id='{base['id']}'] .badge.status-cancelled").count() == 1
    assert page.console_log.errors == []


@pytest.mark.parametrize("path", ["/experiments/987654", "/experiments/abc", "/runs/987654", "/runs/9999999999999",
                                  "/no/such/page"])
def test_a_missing_experiment_run_or_page_is_a_404_page_in_the_sites_design(server, page, path):
    response = page.goto(server.base_url + path)
    assert response.status == 404 and response.headers["content-type"].startswith("text/html")
    assert page.locator("#not-found").is_visible()
    assert page.locator("header.topbar").is_visible()  # the site's own layout, not raw JSON
    text = page.locator("#not-found").inner_text()
    assert "Not found" in text and ("987654" in text or "abc" in text or "no/such/page" in text or "999" in text)
    # The only console line is the browser's own report of the 404 response.
    assert all("404" in e for e in page.console_log.errors)
    # The API keeps its JSON errors.
    api = server.http.get("/api/v1/experiments/987654")
    assert api.status_code == 404 and api.json()["detail"] == "experiment 987654 does not exist"


def test_the_header_shows_the_model_a_run_built_and_where_it_came_from(server, page, charts):
    from tests.training.tiny_architectures import tiny_config

    checkpoint = server.home / "models" / "qwen"  # what the API checks for (its config is read); no worker loads it
    checkpoint.mkdir(parents=True, exist_ok=True)
    tiny_config("qwen2", max_position_embeddings=4096).save_pretrained(checkpoint)
    (checkpoint / "model.safetensors").write_bytes(b"")
    exp = server.create_experiment(["bf16"], name="from-checkpoint", model={"init_from": str(checkpoint)})
    run = exp["runs"][0]
    server.set_status(run["id"], "running", device_name="cpu (test)")
    server.log_loss_curve(run["id"], steps=5, start=4.0)
    model = {"architecture": "Qwen2ForCausalLM", "model_type": "qwen2", "params": 1_234_567,
             "source": "checkpoint", "origin": "models/qwen", "blocks": 2, "vocab_size": 512}
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("loss-chart", 1)
    assert "windows of the held-out split, spread evenly" in page.locator("#experiment-meta").inner_text()
    validation = {"windows": 32, "tokens": 4096, "rule": "spread", "split_windows": 1400, "split_tokens": 179_201}
    server.set_status(run["id"], "succeeded", summary={"final_loss": 1.6, "model": model, "validation": validation})
    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    charts.wait_for_traces("loss-chart", 1)
    meta = page.locator("#experiment-meta").inner_text()
    assert f"Qwen2ForCausalLM · 1.2M parameters · from checkpoint {checkpoint}" in meta
    assert "32 of the held-out split's 1,400 windows (4,096 tokens), spread evenly" in meta


def test_run_row_shows_data_preparation_then_what_the_run_was_trained_on(server, page):
    exp = server.create_experiment(["bf16", "fp8_tensorwise"], name="data-prep")
    base, other = sorted(exp["runs"], key=lambda r: r["recipe"] != "bf16")
    # What workers.jobs.train.ApiSink sends for training.shards' `data_progress` events.
    server.set_status(base["id"], "running", device_name="cpu (test)")
    r = server.http.patch(f"/api/v1/runs/{base['id']}", json={"summary": {"data_progress": {
        "phase": "tokenizing", "documents": 12345, "tokens": 4_000_000, "tokens_per_s": 1_500_000,
        "fraction": 0.25, "eta_s": 300.0, "done": False}}})
    assert r.status_code == 200, r.text
    server.set_status(other["id"], "running", device_name="cpu (test)")
    server.set_status(other["id"], "succeeded", summary={"final_loss": 1.5, "data": {
        "files": 3, "documents_train": 1900, "documents_val": 100, "tokens_train": 2_500_000,
        "tokenizer": "checkpoint", "bad_lines": 2, "val_files_in_train": 1, "val_documents_in_train": 7}})

    page.goto(f"{server.base_url}/experiments/{exp['id']}")
    preparing = page.locator(f"#runs-table tr[data-run-id='{base['id']}'] .data-progress")
    preparing.wait_for(timeout=8000)
    assert preparing.inner_text() == "tokenizing · 12,345 documents · 1.5M tokens/s · 5 min left"
    bar = page.locator(f"#runs-table tr[data-run-id='{base['id']}'] .progress").get_attribute("title")
    assert bar == "25%"
    trained_on = page.locator(f"#runs-table tr[data-run-id='{other['id']}'] .run-data").inner_text()
    assert trained_on == ("3 files · 2.0k documents · 2.5M training tokens · tokenizer checkpoint · 2 bad lines skipped"
                          " · 1 validation file is a training file · 7 of 100 validation documents also in the "
                          "training corpus")
    assert page.console_log.errors == []
