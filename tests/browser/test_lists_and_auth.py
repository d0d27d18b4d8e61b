"""Experiment and run lists, the ablation option of the form, and writes with an API token."""
from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.browser


def test_experiments_list_shows_status_counts_and_the_verdict_on_validation_loss(server, page):
    exp = server.create_experiment(["bf16", "fp8_tensorwise", "nvfp4"], name="list-summary")
    runs = {r["recipe"]: r for r in exp["runs"]}
    # fp8_tensorwise: 1.3× at +0.5% validation loss matches (±1%); nvfp4: 1.6× but +3% does not.
    for recipe, tps, offset in (("bf16", 1000.0, 0.0), ("fp8_tensorwise", 1300.0, 0.5), ("nvfp4", 1600.0, 3.0)):
        server.log_loss_curve(runs[recipe]["id"], steps=50, start=3.0, offset_pct=offset, val_every=10)
        server.set_status(runs[recipe]["id"], "running")
        server.set_status(runs[recipe]["id"], "succeeded", summary={"tokens_per_s": tps})
    worse = server.create_experiment(["bf16", "nvfp4"], name="list-none-within")
    for run, offset in zip(sorted(worse["runs"], key=lambda r: r["recipe"] != "bf16"), (0.0, 3.0)):
        server.log_loss_curve(run["id"], steps=50, start=3.0, offset_pct=offset, val_every=10)
        server.set_status(run["id"], "running")
        server.set_status(run["id"], "succeeded", summary={"tokens_per_s": 1000.0})

    page.goto(server.base_url + "/")
    none_within = page.locator(f"#experiments-table tr[data-experiment-id='{worse['id']}'] .summary")
    page.wait_for_function("sel => document.querySelector(sel)?.textContent.length > 0",
                           arg=f"#experiments-table tr[data-experiment-id='{worse['id']}'] .summary")
    assert none_within.inner_text().startswith("no recipe matches BF16's validation loss (with one BF16 seed, a recipe ")
    row = page.locator(f"#experiments-table tr[data-experiment-id='{exp['id']}']")
    row.wait_for()
    assert row.locator(".experiment-link").inner_text() == "list-summary"
    assert row.locator(".badge.status-succeeded").count() == 1
    assert row.locator(".status-counts").inner_text().split() == ["succeeded", "3"]
    page.wait_for_function("sel => document.querySelector(sel)?.textContent.length > 0",
                           arg=f"#experiments-table tr[data-experiment-id='{exp['id']}'] .summary")
    assert row.locator(".summary").inner_text().startswith(
        "fp8_tensorwise matches BF16 at +0.50% final validation loss, 1.30× BF16's throughput (speedup)")
    row.locator(".experiment-link").click()
    page.wait_for_url(re.compile(rf"/experiments/{exp['id']}$"))
    assert page.console_log.errors == []


def test_runs_list_filters_by_status_and_recipe(server, page):
    exp = server.create_experiment(["bf16", "fp8_rowwise"], name="runs-filter")
    runs = {r["recipe"]: r for r in exp["runs"]}
    server.set_status(runs["fp8_rowwise"]["id"], "running")
    server.set_status(runs["fp8_rowwise"]["id"], "failed", error_message="RuntimeError: planted failure")
    page.goto(f"{server.base_url}/runs?status=failed")
    page.wait_for_selector("#runs-list-body tr[data-run-id]")
    statuses = page.locator("#runs-list-body tr[data-run-id]").evaluate_all("rows => rows.map(r => r.dataset.status)")
    assert statuses and set(statuses) == {"failed"}
    assert "planted failure" in page.locator(f"tr[data-run-id='{runs['fp8_rowwise']['id']}']").inner_text()

    page.select_option("#filter-status", "")
    page.select_option("#filter-recipe", "fp8_rowwise")
    page.wait_for_function("() => [...document.querySelectorAll('#runs-list-body tr[data-run-id]')]"
                           ".every(r => r.querySelector('code').textContent === 'fp8_rowwise')")
    assert "recipe=fp8_rowwise" in page.url
    assert page.console_log.errors == []


def test_an_older_list_answer_arriving_last_does_not_replace_the_filtered_list(server, page):
    """Two filter changes in a row send two requests; on a loaded machine the first one's answer can come back
    last (CI saw it). The list must show the answer to the newest request: the unfiltered answer is held here
    until the filtered one is drawn, then let through."""
    exp = server.create_experiment(["bf16", "fp8_rowwise"], name="runs-order")
    page.goto(f"{server.base_url}/runs?recipe=bf16")
    page.wait_for_selector("#runs-list-body tr[data-run-id]")
    held = []

    def hold_the_unfiltered_one(route):
        if "recipe=" not in route.request.url and not held:
            held.append(route)
        else:
            route.continue_()

    page.route(re.compile(r"/api/v1/runs\?"), hold_the_unfiltered_one)
    page.select_option("#filter-recipe", "")  # every recipe: the answer held
    page.select_option("#filter-recipe", "fp8_rowwise")
    only_fp8 = ("() => { const rows = [...document.querySelectorAll('#runs-list-body tr[data-run-id]')];"
                " return rows.length > 0 && rows.every(r => r.querySelector('code').textContent === 'fp8_rowwise'); }")
    page.wait_for_function(only_fp8)
    assert len(held) == 1
    with page.expect_response(lambda r: r.url == held[0].request.url):
        held[0].continue_()
    page.wait_for_timeout(300)  # the stale answer's JSON parsed and (before the fix) drawn
    assert page.evaluate(only_fp8), page.locator("#runs-list-body").inner_text()
    ids = page.locator("#runs-list-body tr[data-run-id]").evaluate_all("rows => rows.map(r => Number(r.dataset.runId))")
    assert next(r["id"] for r in exp["runs"] if r["recipe"] == "fp8_rowwise") in ids
    assert page.console_log.errors == []


def test_ablation_creates_one_run_per_bf16_last_layers_value(server, page):
    page.goto(f"{server.base_url}/experiments/new")
    page.fill("#field-name", "nvfp4-ablation")
    page.uncheck("#field-enqueue")
    page.click("#ablation-box summary")
    page.check("#field-ablation")
    page.select_option("#field-ablation-recipe", "nvfp4")
    page.fill("#field-ablation-values", "0, 1, 3")
    page.click("#experiment-submit")
    page.wait_for_url(re.compile(r"/experiments/\d+$"))
    exp = server.http.get(f"/api/v1/experiments/{page.url.rsplit('/', 1)[1]}").json()
    assert sorted((r["recipe"], r["bf16_last_layers"]) for r in exp["runs"]) == [
        ("bf16", 0), ("nvfp4", 0), ("nvfp4", 1), ("nvfp4", 3)]
    page.wait_for_selector("#runs-table tbody tr[data-run-id] >> nth=3")
    assert page.console_log.errors == []


def test_writes_use_the_token_pasted_into_the_page(server, tokenless_page, api_token):
    page = tokenless_page
    page.goto(f"{server.base_url}/experiments/new")
    page.fill("#field-name", "needs-token")
    page.uncheck("#field-enqueue")
    page.click("#experiment-submit")
    error = page.locator("#form-error")
    error.wait_for(state="visible")
    assert "API token" in error.inner_text()

    page.click("#api-token-status")
    page.fill("#api-token-input", "not-the-token")
    page.click("#api-token-save")
    page.wait_for_function("() => document.getElementById('api-token-message').textContent.includes('not valid')")
    page.fill("#api-token-input", api_token)
    page.click("#api-token-save")
    page.wait_for_function("() => document.getElementById('api-token-status').textContent === 'Signed in (admin)'")
    page.click("#experiment-submit")
    page.wait_for_url(re.compile(r"/experiments/\d+$"))
    # Nothing of the token is left to scripts: not in storage, and the session cookie is HttpOnly and Strict.
    assert page.evaluate("() => JSON.stringify(localStorage) + JSON.stringify(sessionStorage)") == "{}{}"
    assert "plab_session" not in page.evaluate("() => document.cookie")
    cookie = next(c for c in page.context.cookies() if c["name"] == "plab_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and api_token not in cookie["value"]
    # A script that tried a write without the page's CSRF value is refused even with the cookie.
    status = page.evaluate("""async () => (await fetch('/api/v1/experiments', {method: 'POST',
        headers: {'Content-Type': 'application/json'}, body: JSON.stringify({name: 'x'})})).status""")
    assert status == 403
    # The browser logs the failed fetches: the refused first write (401), the wrong token (401), the forged
    # write (403); nothing else.
    assert len(page.console_log.errors) == 3, page.console_log.errors
    assert all(" 40" in e for e in page.console_log.errors), page.console_log.errors


def test_a_run_waiting_on_slurm_shows_its_job_state_and_reason(server, page):
    exp = server.create_experiment(["bf16"], name="slurm-pending")
    run_id = exp["runs"][0]["id"]
    r = server.http.patch(f"/api/v1/runs/{run_id}", json={"summary": {"slurm": {
        "job_id": "4242", "state": "PENDING", "reason": "Priority", "requeues": 0}}})
    assert r.status_code == 200, r.text
    for url in (f"{server.base_url}/runs?status=queued", f"{server.base_url}/experiments/{exp['id']}"):
        page.goto(url)
        row = page.locator(f"tr[data-run-id='{run_id}']")
        row.wait_for()
        assert "Slurm job 4242: PENDING (Priority)" in row.inner_text()
    assert page.console_log.errors == []
