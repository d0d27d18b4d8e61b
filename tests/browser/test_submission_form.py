"""The submission form creates an experiment through the API and shows the API's message on bad input."""
from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.browser


def test_form_creates_experiment_and_opens_its_page(server, page, charts):
    page.goto(f"{server.base_url}/experiments/new")
    page.fill("#field-name", "from-the-form")
    page.fill("#field-steps", "20")
    page.check("input[name=recipes][value=fp8_tensorwise]")
    page.check("input[name=recipes][value=nvfp4]")
    page.fill("#field-bf16-last", "1")
    page.uncheck("#field-enqueue")
    page.click("#experiment-submit")

    page.wait_for_url(re.compile(r"/experiments/\d+$"))
    exp_id = int(page.url.rsplit("/", 1)[1])
    exp = server.http.get(f"/api/v1/experiments/{exp_id}").json()
    assert exp["name"] == "from-the-form"
    recipes = sorted((r["recipe"], r["bf16_last_layers"]) for r in exp["runs"])
    # BF16 is always the baseline and keeps all layers; the other recipes keep the last block in BF16.
    assert recipes == [("bf16", 0), ("fp8_tensorwise", 1), ("nvfp4", 1)]
    charts.wait_for_traces("loss-chart", 3)
    assert page.locator("#runs-table tbody tr[data-run-id]").count() == 3
    # The runs report losses as a worker would; the open page picks them up without a reload: the overlay
    # has one trace per run, the relative difference one per non-BF16 run (+1% for fp8, +2% for nvfp4).
    by_recipe = {r["recipe"]: r for r in exp["runs"]}
    for recipe, offset in (("bf16", 0.0), ("fp8_tensorwise", 1.0), ("nvfp4", 2.0)):
        server.log_loss_curve(by_recipe[recipe]["id"], steps=20, start=3.0, offset_pct=offset, tokens_per_step=256,
                              tokens_per_s=1000.0)
    page.wait_for_function("() => { const gd = document.getElementById('loss-chart');"
                           " const d = gd && gd.data ? gd.data.filter(t => !t.meta.raw) : [];"
                           " return d.length === 3 && d.every(t => t.x.length === 20); }",
                           timeout=20_000)
    charts.wait_for_traces("relative-chart", 2)
    rel = {t["name"]: t["y"] for t in charts.traces("relative-chart")}
    assert len(rel) == 2
    means = sorted(sum(y) / len(y) for y in rel.values())
    assert abs(means[0] - 1.0) < 0.05 and abs(means[1] - 2.0) < 0.05
    assert page.console_log.errors == []


def test_form_shows_the_api_error_message_on_bad_input(server, page):
    page.goto(f"{server.base_url}/experiments/new")
    page.fill("#field-name", "bad-model")
    page.check("input[name=model_kind][value=custom]")
    page.fill("input[name=num_attention_heads]", "3")  # 256 is not divisible by 3 heads
    page.uncheck("#field-enqueue")
    page.click("#experiment-submit")
    error = page.locator("#form-error")
    error.wait_for(state="visible")
    assert "head" in error.inner_text().lower()
    assert page.url.endswith("/experiments/new")


def test_form_refuses_an_empty_name_before_calling_the_api(server, page):
    requests = []
    page.on("request", lambda r: requests.append(r.url) if r.method == "POST" else None)
    page.goto(f"{server.base_url}/experiments/new")
    page.click("#experiment-submit")
    assert "Name is required" in page.locator("#form-error").inner_text()
    assert requests == []


def test_form_sends_custom_dimensions_and_a_token_budget(server, page):
    page.goto(f"{server.base_url}/experiments/new")
    page.fill("#field-name", "custom-dims")
    page.check("input[name=model_kind][value=custom]")
    page.fill("input[name=hidden_size]", "128")
    page.fill("input[name=intermediate_size]", "384")
    page.fill("input[name=num_hidden_layers]", "2")
    page.fill("input[name=num_attention_heads]", "4")
    page.fill("input[name=num_key_value_heads]", "2")
    page.check("input[name=budget_kind][value=tokens]")
    page.fill("#field-tokens", "65536")
    page.fill("#field-eval-tasks", "blimp, lambada")
    page.uncheck("#field-enqueue")
    page.click("#experiment-submit")
    page.wait_for_url(re.compile(r"/experiments/\d+$"))
    exp = server.http.get(f"/api/v1/experiments/{page.url.rsplit('/', 1)[1]}").json()
    assert exp["model"]["hidden_size"] == 128 and exp["model"]["num_hidden_layers"] == 2
    assert exp["training"]["tokens"] == 65536 and exp["training"]["steps"] is None
    assert exp["eval_tasks"] == ["blimp", "lambada"]
    assert page.console_log.errors == []
