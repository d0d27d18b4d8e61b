"""Stored script payloads in every string the API stores and the pages show – experiment names and
descriptions (rendered as Markdown), run labels, device and host names, error messages, summaries, evaluation task
and metric names, GEMM benchmark names, devices, shapes and notes, tags and notes of experiments and runs,
conversion reports, artifact paths – must reach the page as text: no payload runs, no payload
element appears in the DOM, and the Content-Security-Policy never has to block one (a blocked attempt means
the markup got in)."""
from __future__ import annotations

import copy

import pytest

from training.gemm import run_gemm_benchmark

PAYLOADS = ['<img src=x onerror="window.__xss(1)">', '"><svg onload=window.__xss(2)>',
            "<script>window.__xss(3)</script>", "'><iframe src=javascript:window.__xss(4)>",
            "<a href=\"javascript:window.__xss(5)\">x</a>", "</td></tr><tr><td><img src=y onerror=window.__xss(6)>"]
P = " ".join(PAYLOADS)
S = " ".join(PAYLOADS[i] for i in (0, 1, 5))  # fits the 200-character names and labels

WATCH = """
window.__xssCalls = [];
window.__xss = (n) => window.__xssCalls.push(n);
window.__cspViolations = [];
document.addEventListener('securitypolicyviolation',
  (e) => window.__cspViolations.push(`${e.violatedDirective} ${e.blockedURI} ${e.sourceFile}:${e.lineNumber} `
    + `${e.sample} ${(e.target && e.target.outerHTML || '').slice(0, 120)}`));
"""
INJECTED = "img[src='x'], img[src='y'], svg[onload], iframe, script:not([src]), a[href^='javascript']"


@pytest.fixture(scope="module")
def planted(server):
    """An experiment whose every stored string carries the payloads."""
    exp = server.create_experiment(["bf16", {"name": "fp8_tensorwise", "label": f"fp8 {S}"},
                                    {"name": "nvfp4", "label": f"nvfp4 {S}"}],
                                   name=f"xss {S}", description=f"desc {P}")
    runs = exp["runs"]
    # Markdown that tries to smuggle markup: links with a javascript: target, HTML inside emphasis and code.
    md = f"**{PAYLOADS[0]}** *{PAYLOADS[2]}* `{PAYLOADS[1]}` [x](javascript:window.__xss(7)) [y](https://e.x/{PAYLOADS[1]})"
    tags = [PAYLOADS[0], PAYLOADS[1], PAYLOADS[5]]
    r = server.http.patch(f"/api/v1/experiments/{exp['id']}", json={"tags": tags, "notes": f"{P}\n\n{md}",
                                                                    "description": f"desc {P}\n\n- {md}"})
    assert r.status_code == 200, r.text
    for run in runs:
        r = server.http.patch(f"/api/v1/runs/{run['id']}", json={"tags": tags, "notes": f"{md}\n{P}",
            "conversion_report": {"gemm_backend": "emulated", "device": S, "notes": [P],
                                  "layers": [{"name": S, "block": 0, "in_features": S, "out_features": 1,
                                              "converted": False, "backend": S, "reason": P}]}})
        assert r.status_code == 200, r.text
    for i, run in enumerate(runs):
        server.log_loss_curve(run["id"], steps=20, start=4.0, offset_pct=i, val_every=5, tokens_per_s=1000 + i)
        server.set_status(run["id"], "running", device_name=f"dev {S}", worker_host=f"host {S}")
    server.set_status(runs[0]["id"], "succeeded", summary={"final_loss": 1.6, "tokens_per_s": 1000.0, "note": P})
    server.set_status(runs[1]["id"], "failed", error_message=f"Traceback {P}")
    r = server.http.post(f"/api/v1/runs/{runs[0]['id']}/artifacts", json={"kind": "checkpoint", "path": f"/tmp/{S}"})
    assert r.status_code in (200, 201), r.text
    ev = server.http.post(f"/api/v1/runs/{runs[0]['id']}/evaluations", json={"tasks": ["plab_piqa"], "limit": 5})
    assert ev.status_code in (201, 503), ev.text
    if ev.status_code == 201:
        eid = ev.json()["id"]
        r = server.http.post(f"/api/v1/evaluations/{eid}/results", json={
            "task": f"plab_piqa {S}", "result": {"metrics": {f"acc {P}": {"value": 0.5, "stderr": 0.1}},
                                                 "task_hash": P, "n_samples": 5}})
        assert r.status_code in (200, 201, 422), r.text
    result = run_gemm_benchmark(model="tiny", micro_batch=2, seq_len=16, vocab_size=256,
                                formats=["bf16", "fp8_tensorwise"], device="cpu", repeats=1, warmup=0,
                                compile_quant=False)
    poisoned = copy.deepcopy(result)
    poisoned["device"]["name"] = f"cpu {S}"
    for shape in poisoned.get("shapes", []):
        shape["layer"] = f"{shape['layer']} {S}"
    for rec in poisoned.get("results", []):
        rec["note"] = P
    r = server.http.post("/api/v1/gemm-benchmarks", json={"result": poisoned, "experiment_id": exp["id"],
                                                           "name": f"bench {S}"})
    assert r.status_code == 201, r.text
    # Numbers the shapes table once put into the page raw are refused as strings now (tests/backend/test_bounds.py)
    shape = dict(poisoned["shapes"][0], count=S)
    r = server.http.post("/api/v1/gemm-benchmarks", json={"result": {**poisoned, "shapes": [shape]}})
    assert r.status_code == 422, r.text
    return exp


def visit(page, url: str, wait_for: str) -> dict:
    page.add_init_script(WATCH)
    page.goto(url)
    try:
        page.wait_for_selector(wait_for)
    except Exception as exc:  # noqa: BLE001 - say what the page said
        raise AssertionError(f"{url}: {wait_for} never appeared; console: {page.console_log.errors}") from exc
    page.wait_for_timeout(1500)  # polls, panels and charts settle
    return page.evaluate(f"""() => ({{calls: window.__xssCalls, csp: window.__cspViolations,
        injected: [...document.querySelectorAll({INJECTED!r})].map((e) => e.outerHTML.slice(0, 80)),
        text: document.body.innerText}})""")


@pytest.mark.parametrize("where", ["list", "experiment", "runs", "new", "run", "failed-run"])
def test_no_stored_payload_runs_or_becomes_markup_on_any_page(server, page, planted, where):
    url, wait_for = {"list": ("/", ".experiment-link"),
                     "experiment": (f"/experiments/{planted['id']}", "#runs-body tr[data-run-id]"),
                     "runs": ("/runs", "#runs-list-body tr[data-run-id]"),
                     "new": ("/experiments/new", "#recipes-fieldset"),
                     "run": (f"/runs/{planted['runs'][0]['id']}", "#run-checkpoints tr[data-artifact-id]"),
                     "failed-run": (f"/runs/{planted['runs'][1]['id']}", "#run-errors .run-error")}[where]
    seen = visit(page, server.base_url + url, wait_for)
    assert seen["calls"] == [], seen["calls"]
    assert seen["injected"] == [], seen["injected"]
    assert seen["csp"] == [], seen["csp"]
    assert page.console_log.errors == [] or all("__xss" not in e for e in page.console_log.errors)
    if where in ("list", "experiment", "run"):
        assert '<img src=x onerror="window.__xss(1)">' in seen["text"]  # shown, as text
    if where == "experiment":
        # In Plotly's legends too, character for character: Plotly decodes numeric entities and &amp; &lt; &gt;
        # only, and a quote escaped as &quot; was shown as those six characters.
        page.wait_for_function("document.querySelectorAll('#loss-chart .legendtext').length > 0")
        legend = page.eval_on_selector_all("#loss-chart .legendtext", "els => els.map(e => e.textContent)")
        assert any('fp8 <img src=x onerror="window.__xss(1)">' in t for t in legend), legend
        assert not any("&quot;" in t or "&#" in t for t in legend), legend


def test_the_javascript_has_one_markup_sink():
    """innerHTML is assigned in dom.js only (setHTML takes html`` output, whose interpolations are escaped)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "frontend" / "static" / "js"
    sink = re.compile(r"\.(innerHTML|outerHTML)\s*=(?!=)|insertAdjacentHTML\s*\(|document\.write\s*\(")
    offenders = [f"{p.name}:{i}" for p in sorted(root.rglob("*.js")) if p.name != "dom.js"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if sink.search(line)]
    assert offenders == []
