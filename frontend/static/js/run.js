// Run page: the run's spec (every default filled in) and how it differs from the BF16 run's, the conversion
// report, events and errors, checkpoints (downloaded through the API, which serves only the run's own folder),
// evaluations and one chart per logged metric. Polls while a worker-trained run is queued or running.
import { get, formatDate, LIVE_STATUSES, post, showGlobalError } from "./api.js";
import { html, joinHtml, plotText, setHTML, statusBadge, urlPath } from "./dom.js";
import { mountHousekeeping } from "./housekeeping.js";
import { DEFAULT_SMOOTHING, loadPlotly, PLOT_CONFIG, smoothedTraces } from "./plot.js";
import { poke, register } from "./poller.js";
import { ema } from "./series.js";
import { gemmBackend, runLabel } from "./summary.js";

const root = document.getElementById("run-root");
const runId = root.dataset.runId;
const api = (...parts) => `/api/v1${urlPath(...parts)}`;
// While the run is live, its charts are re-read every METRICS_EVERY_MS (one request per key), the rest every poll.
const METRICS_EVERY_MS = 10_000;
// A run that ended this way can be queued again (POST /runs/{id}/retry); a diverged one would diverge again.
const RETRYABLE = new Set(["failed", "cancelled"]);
const state = { run: null, baseline: null, experiment: null, keys: [], smoothing: DEFAULT_SMOOTHING, gone: false,
  drawn: new Map(), metricsAt: 0 };

// ------------------------------------------------------------------ spec and its difference to BF16
export function flatten(value, prefix = "", out = {}) {
  if (value && typeof value === "object" && !Array.isArray(value) && Object.keys(value).length) {
    for (const [k, v] of Object.entries(value)) flatten(v, prefix ? `${prefix}.${k}` : k, out);
  } else if (prefix) {
    out[prefix] = JSON.stringify(value);
  }
  return out;
}

export function specDiff(base, other) {
  const a = flatten(base || {}), b = flatten(other || {});
  return [...new Set([...Object.keys(a), ...Object.keys(b)])].sort()
    .filter((k) => a[k] !== b[k]).map((k) => ({ field: k, baseline: a[k], run: b[k] }));
}

function renderSpec() {
  const { run, baseline } = state;
  document.getElementById("run-spec").textContent = JSON.stringify(run.spec || {}, null, 2);
  const body = document.querySelector("#run-spec-diff tbody");
  let rows;
  if (!baseline) rows = html`<tr class="placeholder"><td colspan="3">No BF16 run in this experiment to compare with.</td></tr>`;
  else if (baseline.id === run.id) rows = html`<tr class="placeholder"><td colspan="3">This is the BF16 run: the others are compared with it.</td></tr>`;
  else {
    const diff = specDiff(baseline.spec, run.spec);
    rows = diff.length ? joinHtml(diff.map((d) => html`<tr data-field="${d.field}"><td><code>${d.field}</code></td>
        <td>${d.baseline ?? "–"}</td><td>${d.run ?? "–"}</td></tr>`))
      : html`<tr class="placeholder"><td colspan="3">Same spec as the BF16 run.</td></tr>`;
  }
  setHTML(body, rows);
}

// ------------------------------------------------------------------ conversion report
function renderConversion() {
  const report = state.run.conversion_report || {};
  const layers = Array.isArray(report.layers) ? report.layers : [];
  const el = document.getElementById("conversion-report");
  if (!layers.length) {
    setHTML(el, html`<p class="muted one-line">${state.run.external ? "Record-only runs send no conversion report."
      : "No conversion report yet: the worker sends it when the model is built."}</p>`);
    return;
  }
  const converted = layers.filter((l) => l.converted).length;
  const kept = new Map();
  for (const l of layers.filter((x) => !x.converted)) {
    const reason = l.reason || "kept in BF16";
    kept.set(reason, (kept.get(reason) || 0) + 1);
  }
  setHTML(el, html`
    <p id="conversion-summary"><strong>${converted} of ${layers.length}</strong> linear layers converted
      (${report.gemm_backend || gemmBackend(state.run) || "?"} GEMMs${report.device ? `, ${report.device}` : ""}).</p>
    ${kept.size > 0 && html`<ul class="kept-reasons">${[...kept].map(([reason, n]) => html`<li>${n} ${
      /^kept in BF16\b/.test(reason) ? reason : `kept in BF16: ${reason}`}</li>`)}</ul>`}
    ${(report.notes || []).length > 0 && html`<p class="hint">${(report.notes || []).join("; ")}</p>`}
    <details><summary>Every layer</summary><div class="table-scroll"><table class="data-table" id="conversion-layers">
      <thead><tr><th>Layer</th><th>Shape (in → out)</th><th>Converted</th><th>Backend</th><th>Why</th></tr></thead>
      <tbody>${layers.map((l) => html`<tr class="${l.converted ? "converted" : "kept"}"><td><code>${l.name}</code></td>
        <td>${l.in_features} → ${l.out_features}</td><td>${l.converted ? "yes" : "no (BF16)"}</td><td>${l.backend}</td>
        <td>${l.reason || ""}</td></tr>`)}</tbody></table></div></details>`);
}

// ------------------------------------------------------------------ events and errors
function event(time, text, detail) {
  return { time, text, detail };
}

function runEvents(run, artifacts, evaluations) {
  const events = [event(run.created_at, run.external ? "registered (record-only)" : "queued")];
  if (run.started_at) events.push(event(run.started_at, `started${run.attempts > 1 ? ` (attempt ${run.attempts})` : ""}`
    + (run.worker_host ? ` on ${run.worker_host}` : "")));
  for (const a of artifacts) events.push(event(a.created_at, `${a.kind}${a.step != null ? ` at step ${a.step}` : ""}`));
  for (const e of evaluations) {
    events.push(event(e.created_at, `evaluation #${e.id} requested (${(e.tasks || []).join(", ")})`));
    if (e.finished_at) events.push(event(e.finished_at, `evaluation #${e.id} ${e.status}`));
  }
  if (run.diverged_step != null) events.push(event(run.finished_at, `diverged at step ${run.diverged_step}`));
  if (run.finished_at) events.push(event(run.finished_at, run.status));
  else if (run.cancel_requested) events.push(event(null, "cancel requested: the worker stops at the next step"));
  return events.sort((a, b) => (a.time ? Date.parse(a.time) : Infinity) - (b.time ? Date.parse(b.time) : Infinity));
}

// A traceback shows its last line (the exception) and folds the rest.
export function errorBlock(message) {
  const lines = String(message).trimEnd().split("\n");
  if (lines.length <= 2) return html`<p class="run-error">${message}</p>`;
  return html`<details class="traceback"><summary class="run-error">${lines[lines.length - 1]}</summary>
    <pre class="code-block">${message}</pre></details>`;
}

function renderEvents(artifacts, evaluations) {
  const run = state.run;
  setHTML(document.getElementById("run-events"), joinHtml(runEvents(run, artifacts, evaluations).map((e) =>
    html`<li><span class="muted">${e.time ? formatDate(e.time) : "now"}</span> ${e.text}</li>`)));
  const errors = [run.error_message, ...evaluations.filter((e) => e.error_message)
    .map((e) => `evaluation #${e.id}: ${e.error_message}`)].filter(Boolean);
  document.getElementById("run-errors-panel").hidden = !errors.length;
  setHTML(document.getElementById("run-errors"), joinHtml(errors.map(errorBlock)));
}

// ------------------------------------------------------------------ checkpoints, evaluations
function renderArtifacts(artifacts) {
  const body = document.querySelector("#run-checkpoints tbody");
  setHTML(body, artifacts.length ? joinHtml(artifacts.map((a) => html`<tr data-artifact-id="${a.id}">
      <td>${a.kind}</td><td class="num">${a.step ?? ""}</td><td><code class="path">${a.path}</code></td>
      <td>${formatDate(a.created_at)}</td>
      <td>${a.exists === true ? html`<a class="checkpoint-download" download
          href="${api("runs", runId, "artifacts", a.id, "download")}">Download</a>`
        : html`<span class="muted">${a.exists === null ? "stored at a URL" : "no longer on disk"}</span>`}</td></tr>`))
    : html`<tr class="placeholder"><td colspan="5">No checkpoints or files recorded.</td></tr>`);
}

function resultText(result) {
  const metrics = result.metrics || {};
  const parts = Object.entries(metrics).filter(([, m]) => m && typeof m.value === "number")
    .map(([name, m]) => (/^acc/.test(name) ? `${name} ${(100 * m.value).toFixed(1)}%` : `${name} ${m.value.toPrecision(4)}`));
  return `${result.task}: ${parts.join(", ") || "–"}`;
}

// An evaluation's limit, as lm-eval's --limit: documents per task, or a fraction of each task's documents.
function limitNote(limit) {
  if (typeof limit !== "number") return "";
  return limit < 1 ? ` (${Number((100 * limit).toPrecision(3))}% of each task's documents)` : ` (${limit} documents per task)`;
}

function renderEvaluations(evaluations) {
  const body = document.querySelector("#run-evaluations tbody");
  setHTML(body, evaluations.length ? joinHtml(evaluations.map((e) => html`<tr data-evaluation-id="${e.id}">
      <td>${e.id}</td><td>${(e.tasks || []).join(", ")}${limitNote(e.limit)}</td>
      <td>${statusBadge(e.status)}</td><td>${joinHtml((e.results || []).map(resultText), html`<br>`)}</td>
      <td>${formatDate(e.finished_at)}</td></tr>`))
    : html`<tr class="placeholder"><td colspan="5">No evaluations of this run.</td></tr>`);
}

// ------------------------------------------------------------------ metrics: one chart per key
function chartId(key) {
  return `metric-${key.replace(/[^A-Za-z0-9_-]/g, "_")}`;
}

async function drawMetrics() {
  const keys = state.keys.filter((k) => !k.key.startsWith("numerics/"));
  const numerics = state.keys.length - keys.length;
  document.getElementById("run-metrics-note").textContent = (keys.length ? "" : "No metrics logged yet. ")
    + (numerics ? `${numerics} numerics series (per layer) are drawn as a heatmap on the experiment page.` : "");
  const grid = document.getElementById("run-metrics");
  const wanted = keys.map((k) => chartId(k.key)).join(",");
  if (grid.dataset.keys !== wanted) {
    setHTML(grid, joinHtml(keys.map((k) => html`<div class="chart chart-metric" id="${chartId(k.key)}"
      data-key="${k.key}"></div>`)));
    grid.dataset.keys = wanted;
  }
  if (!keys.length) return;
  const fresh = Date.now() - state.metricsAt < METRICS_EVERY_MS && keys.every((k) => state.drawn.has(k.key));
  if (fresh) return;
  state.metricsAt = Date.now();
  await loadPlotly();
  await Promise.all(keys.map(async (k) => {
    const s = await get(`${api("runs", runId, "metrics")}/${k.key.split("/").map(encodeURIComponent).join("/")}?max_points=1000`);
    state.drawn.set(k.key, s);
    plotMetric(k.key, s);
  }));
}

// The unit of each metric the training loop logs (training/train.py, training/metrics_drain.py), for its y axis.
const METRIC_UNITS = {
  "train/loss": "nats/token", "val/loss": "nats/token", "train/lr": "learning rate", "train/grad_norm": "L2 norm",
  "perf/step_time_s": "s", "perf/data_wait_s": "s", "perf/host_issue_s": "s", "perf/tokens_per_s": "tokens/s",
  "perf/tflops": "TFLOP/s", "perf/mfu": "fraction of dense BF16 peak", "perf/peak_mem_gib": "GiB",
};

export function metricAxisTitle(key, gemm) {
  const unit = METRIC_UNITS[key] || (key.endsWith("_s") ? "s" : "");
  // an emulated run's speed figures time BF16/FP32 GEMMs on dequantized values, not the format's kernels
  const caveat = gemm === "emulated" && key.startsWith("perf/") && key !== "perf/peak_mem_gib"
    ? " - emulated GEMMs, not a speed claim" : "";
  return `${unit}${caveat}`;
}

function plotMetric(key, s) {
  const traces = smoothedTraces({ name: plotText(key), x: s.step, y: s.value, color: "#2457c5",
    smoothing: state.smoothing, meta: { run_id: Number(runId), key } }, ema);
  const axis = metricAxisTitle(key, gemmBackend(state.run));
  window.Plotly.react(chartId(key), traces, {
    title: { text: plotText(key), font: { size: 13 } }, margin: { l: 55, r: 10, t: 32, b: 36 },
    xaxis: { title: { text: "step" } }, yaxis: { title: { text: plotText(axis), font: { size: 11 } } },
    showlegend: false, uirevision: key,
  }, PLOT_CONFIG);
}

// ------------------------------------------------------------------ load and poll
let housekeeping = null;

function renderHeader() {
  const run = state.run;
  document.getElementById("run-name").textContent = `#${run.id} ${runLabel(run)}`;
  document.title = `${runLabel(run)} · run ${run.id} · Precision Lab`;
  setHTML(document.getElementById("run-status"), html`${statusBadge(run.status)}${run.external
    && html` <span class="badge record-only" title="logged by the user's script, not trained by a worker">record-only</span>`}`);
  const link = document.getElementById("run-experiment-link");
  link.href = urlPath("experiments", run.experiment_id);
  link.textContent = state.experiment ? `experiment: ${state.experiment.name}` : `experiment ${run.experiment_id}`;
  link.hidden = false;
  document.getElementById("run-record-only").hidden = !run.external;
  document.getElementById("run-cancel").hidden = run.external || !LIVE_STATUSES.has(run.status) || run.cancel_requested;
  document.getElementById("run-retry").hidden = run.external || !RETRYABLE.has(run.status);
  const entries = [["recipe", run.recipe], ["GEMMs", gemmBackend(run)], ["device", run.device_name],
    ["worker", run.worker_host], ["attempts", run.attempts || ""],
    ["resumed at step", (run.summary || {}).resumed_from_step], ["created", formatDate(run.created_at)],
    ["finished", formatDate(run.finished_at)]].filter(([, v]) => v !== "" && v != null);
  setHTML(document.getElementById("run-meta"), joinHtml(entries.map(([k, v]) => html`<div><dt>${k}</dt><dd>${v}</dd></div>`)));
}

async function refresh() {
  try {
    const run = await get(api("runs", runId));
    state.run = run;
    const [experiment, artifacts, evaluations, keys] = await Promise.all([
      state.experiment ? Promise.resolve(state.experiment) : get(api("experiments", run.experiment_id)),
      get(api("runs", runId, "artifacts")), get(api("runs", runId, "evaluations")).catch(() => []),
      get(api("runs", runId, "metrics")),
    ]);
    state.experiment = experiment;
    const base = (experiment.runs || []).find((r) => r.recipe === (experiment.baseline || "bf16"));
    if (base && !state.baseline) state.baseline = base.id === run.id ? run : await get(api("runs", base.id));
    state.keys = keys.keys || [];
    renderHeader();
    housekeeping.update(run);
    renderSpec();
    renderConversion();
    renderEvents(artifacts, evaluations);
    renderArtifacts(artifacts);
    renderEvaluations(evaluations);
    await drawMetrics();
    showGlobalError("");
  } catch (err) {
    if (err.status === 404) state.gone = true;
    showGlobalError(`Could not load run ${runId}: ${err.message}`);
  }
}

housekeeping = mountHousekeeping(document.getElementById("run-housekeeping"), {
  kind: "runs", nameField: "label", hasDescription: false, describe: (r) => `run ${r.id} (${runLabel(r)})`,
  onSaved: (saved) => { state.run = { ...state.run, ...saved }; renderHeader(); },
  onDeleted: () => { window.location.assign(urlPath("experiments", state.run.experiment_id)); },
});
// A button that asks, then posts one action on the run (cancel, retry) and polls at once.
function runAction(id, action, question) {
  document.getElementById(id).addEventListener("click", async (event) => {
    if (!window.confirm(question())) return;
    event.target.disabled = true;
    try {
      await post(`${api("runs", runId)}/${action}`);
      showGlobalError("");
    } catch (err) {
      showGlobalError(`${action[0].toUpperCase()}${action.slice(1)} failed: ${err.message}`);
    }
    event.target.disabled = false;
    poke();
  });
}
runAction("run-cancel", "cancel",
  () => `Cancel ${runLabel(state.run)}? A running job stops at its next step; a queued one never starts.`);
runAction("run-retry", "retry", () => `Retry ${runLabel(state.run)}? It is queued again and resumes from its last `
  + "checkpoint; its metrics so far are kept.");
document.getElementById("run-smoothing").addEventListener("input", (event) => {
  state.smoothing = Number(event.target.value);
  document.getElementById("run-smoothing-value").textContent = state.smoothing.toFixed(2);
  if (window.Plotly) for (const [key, s] of state.drawn) plotMetric(key, s);
});
// Record-only runs change only when their own script reports: they are not polled.
register({ name: "run", refresh,
  live: () => !state.gone && state.run != null && !state.run.external && LIVE_STATUSES.has(state.run.status) });
window.plabRun = state;
