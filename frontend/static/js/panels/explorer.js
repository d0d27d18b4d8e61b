// Metric explorer of the experiment page: one chart per chosen metric key, every run overlaid (the experiment's,
// plus any run added by id, from any experiment), with the page's own x-axis and smoothing controls (#x-axis,
// #smoothing). Gradient norm and learning rate are shown by default; any logged key can be added.
import { get, items, LIVE_STATUSES, showGlobalError } from "../api.js";
import { html, joinHtml, plotText, setHTML, urlPath } from "../dom.js";
import { BOTTOM_LEGEND, colorAt, loadPlotly, PLOT_CONFIG, smoothedTraces } from "../plot.js";
import { poke, register } from "../poller.js";
import { ema, relativeWallTime } from "../series.js";
import { runLabel } from "../summary.js";

export const DEFAULT_KEYS = ["train/grad_norm", "train/lr"];
const MAX_POINTS = 1000;
const X_TITLES = { step: "step", tokens: "tokens", wall_time: "wall time (s since run start)" };

const explorer = { keys: [...DEFAULT_KEYS], extraRuns: [], runs: [], series: new Map(), available: [], live: false,
  loading: null };

export function chartIdOf(key) {
  return `explore-${key.replace(/[^A-Za-z0-9_-]/g, "_")}`;
}

function controls() {
  return { x: document.getElementById("x-axis")?.value || "step",
    smoothing: Number(document.getElementById("smoothing")?.value || 0) };
}

function xOf(points, x) {
  if (x === "wall_time") return relativeWallTime(points.wall_time || []);
  return (x === "tokens" ? points.tokens : points.step) || [];
}

async function fetchAll(experimentId) {
  const { x } = controls();
  const keys = explorer.keys.join(",");
  const params = new URLSearchParams({ keys, max_points: String(MAX_POINTS), x });
  const [data, keyList] = await Promise.all([
    get(`/api/v1/experiments/${encodeURIComponent(experimentId)}/series?${params}`),
    get(`/api/v1/experiments/${encodeURIComponent(experimentId)}/metrics`),
  ]);
  const runs = items(data, "runs").map((r) => ({ id: r.run_id, recipe: r.recipe, label: r.label, status: r.status,
    series: r.series || {} }));
  for (const id of explorer.extraRuns) {
    if (runs.some((r) => r.id === id)) continue;
    let run;
    const series = {};
    try {
      run = await get(`/api/v1${urlPath("runs", id)}`);
      await Promise.all(explorer.keys.map(async (key) => {
        series[key] = await get(`/api/v1${urlPath("runs", id, "metrics")}/${key.split("/").map(encodeURIComponent).join("/")}`
          + `?max_points=${MAX_POINTS}&x=${x}`);
      }));
    } catch (err) {
      explorer.extraRuns = explorer.extraRuns.filter((r) => r !== id);
      // Next to the form that asked for it (the page's banner is far above and cleared by the next poll).
      explorerError(`Run ${id} could not be added: ${err.message}`);
      continue;
    }
    runs.push({ id: run.id, recipe: run.recipe, label: `${runLabel(run)} (run ${run.id}, experiment ${run.experiment_id})`,
      status: run.status, series, external: run.external });
  }
  explorer.runs = runs;
  explorer.available = (keyList.keys || []).map((k) => k.key).filter((k) => !k.startsWith("numerics/"));
  explorer.live = runs.some((r) => LIVE_STATUSES.has(r.status) && !r.external);
}

function renderControls() {
  const select = document.getElementById("explorer-key");
  const options = explorer.available.filter((k) => !explorer.keys.includes(k));
  const wanted = options.join(",");
  if (select.dataset.keys !== wanted) {
    setHTML(select, html`<option value="">add a metric…</option>${options.map((k) => html`<option value="${k}">${k}</option>`)}`);
    select.dataset.keys = wanted;
  }
}

function renderCharts() {
  const box = document.getElementById("explorer-charts");
  const wanted = explorer.keys.join(",");
  if (box.dataset.keys !== wanted) {
    setHTML(box, joinHtml(explorer.keys.map((key) => html`<div class="explorer-item" data-key="${key}">
      <div class="explorer-item-head"><code>${key}</code>
        <button type="button" class="explorer-remove" data-key="${key}" title="remove this chart">×</button></div>
      <p class="muted one-line explorer-empty" hidden></p>
      <div class="chart chart-metric" id="${chartIdOf(key)}"></div></div>`)));
    box.dataset.keys = wanted;
  }
  const { x, smoothing } = controls();
  for (const key of explorer.keys) {
    const traces = explorer.runs.flatMap((run, i) => {
      const s = run.series[key];
      if (!s || !(s.value || []).length) return [];
      return smoothedTraces({ name: plotText(run.label || run.recipe), x: xOf(s, x), y: s.value,
        color: run.recipe === "bf16" ? "#111111" : colorAt(i), smoothing, meta: { run_id: run.id, key } }, ema);
    });
    const item = box.querySelector(`.explorer-item[data-key="${CSS.escape(key)}"]`);
    const empty = item.querySelector(".explorer-empty");
    const chart = document.getElementById(chartIdOf(key));
    // A key no run logged collapses to one line instead of drawing empty axes.
    empty.hidden = traces.length > 0;
    empty.textContent = traces.length ? "" : "not logged by any of these runs";
    chart.hidden = !traces.length;
    if (!traces.length) continue;
    window.Plotly.react(chart, traces, {
      margin: { l: 60, r: 10, t: 10, b: 40 }, xaxis: { title: { text: X_TITLES[x], standoff: 6 }, automargin: true },
      yaxis: { title: { text: plotText(key) }, exponentformat: "e" }, hovermode: "x unified",
      legend: BOTTOM_LEGEND, uirevision: `${key}|${x}`,
    }, PLOT_CONFIG);
  }
}

// The loss curves and the runs table come first: the explorer's requests wait until they are drawn.
function firstRender() {
  if (window.plabExperiment?.firstRenderMs != null) return Promise.resolve();
  return new Promise((resolve) => document.addEventListener("plab:first-render", resolve, { once: true }));
}

async function refresh(experimentId) {
  if (explorer.loading) return explorer.loading;
  explorer.loading = (async () => {
    try {
      await firstRender();
      await fetchAll(experimentId);
      await loadPlotly();
      renderControls();
      renderCharts();
    } catch (err) {
      if (err.status !== 404) showGlobalError(`Metric explorer: ${err.message}`);
    } finally {
      explorer.loading = null;
    }
  })();
  return explorer.loading;
}

function explorerError(text) {
  const el = document.getElementById("explorer-error");
  if (!el) return;
  el.textContent = text;
  el.hidden = !text;
}

export function mount(experimentId) {
  const panel = document.getElementById("explorer-panel");
  if (!panel) return;
  const redraw = () => { if (window.Plotly && explorer.runs.length) renderCharts(); };
  document.getElementById("x-axis").addEventListener("change", () => refresh(experimentId));
  document.getElementById("smoothing").addEventListener("input", redraw);
  document.getElementById("explorer-key").addEventListener("change", (event) => {
    const key = event.target.value;
    if (key && !explorer.keys.includes(key)) explorer.keys.push(key);
    refresh(experimentId);
  });
  document.getElementById("explorer-add-run").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("explorer-run-id");
    const id = Number(input.value);
    if (!Number.isInteger(id) || id < 1) { explorerError("A run id is a positive whole number (see the Runs page)."); return; }
    explorerError("");
    if (!explorer.extraRuns.includes(id)) explorer.extraRuns.push(id);
    input.value = "";
    refresh(experimentId).then(() => poke());
  });
  panel.addEventListener("click", (event) => {
    const button = event.target.closest("button.explorer-remove");
    if (!button) return;
    explorer.keys = explorer.keys.filter((k) => k !== button.dataset.key);
    renderControls();
    renderCharts();
  });
  register({ name: "explorer", everyMs: 5000, refresh: () => refresh(experimentId), live: () => explorer.live });
  window.plabExplorer = explorer;
}
