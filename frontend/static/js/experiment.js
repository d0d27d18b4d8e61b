// Experiment page: loss curves of every run (one trace per run), relative difference to the baseline, speed
// and memory bars, and the runs table; polls every 2 s while any run is queued or running.
import { get, post, items, formatDate, newestOnly, showGlobalError, LIVE_STATUSES } from "./api.js";
import { html, joinHtml, plotText, setHTML, slurmNote, statusBadge, urlPath } from "./dom.js";
import {
  BASELINE, dataPreparation, dataSummary, finalLoss, gemmBackend, mfu, mfuPercent, MFU_CONVENTION, peakMemory,
  progressFraction, recipeName,
  runLabel, runSummary,
  tokensPerSecond,
} from "./summary.js";
import { cleanPoints, ema, median, relativeWallTime } from "./series.js";
import {
  BASELINE_COLOR, BOTTOM_LEGEND, colorAt, DEFAULT_SMOOTHING, emulatedPattern, loadPlotly, PLOT_CONFIG, smoothedTraces,
} from "./plot.js";
import { poke, register } from "./poller.js";
import { mount as mountAccuracy } from "./panels/accuracy.js";
import { mount as mountGemm } from "./panels/gemm.js";
import { mount as mountVerdict, seedBandTraces } from "./panels/verdict.js";
// ---- pages helper (issue 17 items 4-8, 10): explorer, export, housekeeping, states
import { mount as mountExplorer } from "./panels/explorer.js";
import { mount as mountExport } from "./export.js";
import { mountHousekeeping } from "./housekeeping.js";
import { renderMarkdown } from "./markdown.js";
import { collapsePanel, liveRuns, statusLine, workerNote } from "./states.js";
// ---- end pages helper

const root = document.getElementById("experiment-root");
const experimentId = root.dataset.experimentId;
const LOSS_KEYS = ["train/loss", "val/loss"];
const PERF_KEYS = ["perf/tokens_per_s", "perf/peak_mem_gib", "perf/mfu"];
const MAX_POINTS = 1000;
const X_TITLES = { step: "step", tokens: "tokens", wall_time: "wall time (s since run start)" };

const state = {
  experiment: null,
  runs: [],
  series: new Map(), // run_id → {key: {step, tokens, wall_time, value}}
  perf: new Map(),
  xMode: "step",
  smoothing: DEFAULT_SMOOTHING,
  logScale: false,
  zoom: null, // [x_min, x_max] on the server's x axis while the user is zoomed in
  // The API's comparison (GET /experiments/{id}/comparison): every run's relative train-loss difference to the
  // baseline run, on bucket means for long runs; null when the experiment has no BF16 run.
  comparison: null,
  comparisonX: "tokens",
  polls: 0,
  failed: false,
  gone: false,
  firstRenderMs: null,
  tableReadyMs: null,
};

// ---------------------------------------------------------------- data
async function fetchSeries(keys, maxPoints, { withZoom }) {
  const params = new URLSearchParams({ keys: keys.join(","), max_points: String(maxPoints), x: state.xMode });
  if (withZoom && state.zoom) {
    params.set("x_min", String(state.zoom[0]));
    params.set("x_max", String(state.zoom[1]));
  }
  const data = await get(`/api/v1/experiments/${encodeURIComponent(experimentId)}/series?${params}`);
  const byRun = new Map();
  for (const entry of items(data, "runs")) byRun.set(String(entry.run_id), entry.series || {});
  return byRun;
}

// The relative difference to BF16 comes from the API, which compares long runs through the rollup's bucket means
// (mean loss at mean tokens): the loss series the page draws are downsampled to each bucket's min and max point,
// and a difference of two runs' extremes is mostly their step-to-step noise (a 0.5% offset under 5% noise).
async function fetchComparison(x) {
  const params = new URLSearchParams({ x, max_points: String(MAX_POINTS) });
  try {
    return await get(`/api/v1/experiments/${encodeURIComponent(experimentId)}/comparison?${params}`);
  } catch (err) {
    if (err.status === 409) return null; // no BF16 run yet
    throw err;
  }
}

function seriesHaveTokens(series) {
  for (const byKey of series.values()) {
    if ((byKey["train/loss"]?.tokens || []).some((t) => t != null)) return true;
  }
  return series.size === 0;
}

// plotly.js (4.6 MB) takes the browser a second or more to parse on a busy machine: `refresh` loads it only after
// the first API requests are on their way, so the server answers while the browser parses (plot.js).

// Loss-series answers can arrive out of order (a poll in flight while the user zooms): only the answer to
// the latest request is drawn.
const lossTicket = newestOnly();
function fetchLossSeries() {
  const current = lossTicket();
  return fetchSeries(LOSS_KEYS, MAX_POINTS, { withZoom: true }).then((series) => ({ series, latest: current() }));
}

async function refresh() {
  const requests = Promise.all([
    get(`/api/v1/experiments/${encodeURIComponent(experimentId)}`),
    fetchLossSeries(),
    fetchComparison(state.comparisonX),
  ]);
  const plotly = loadPlotly();
  plotly.catch(() => {}); // awaited below; this only keeps an early API failure from orphaning it
  const [experiment, loss, comparison] = await requests;
  if (state.firstRenderMs == null) performance.mark("plab:data-ready");
  state.experiment = experiment;
  state.runs = orderRuns(items(experiment.runs || [], "runs"));
  if (loss.latest) state.series = loss.series;
  state.comparison = comparison;
  // Runs logged without token counts are compared on steps (asked again once their series show it).
  const x = state.zoom || !loss.latest ? state.comparisonX : (seriesHaveTokens(state.series) ? "tokens" : "step");
  if (x !== state.comparisonX) {
    state.comparisonX = x;
    state.comparison = await fetchComparison(x);
  }
  // Statuses, progress and cancel buttons need no plotly.js: show them as soon as the data is here.
  renderHeader();
  renderTable();
  if (state.tableReadyMs == null) {
    performance.mark("plab:table-ready");
    state.tableReadyMs = performance.now();
  }
  await plotly;
  drawCharts();
  if (state.firstRenderMs == null) {
    // Navigation start to loss curves, comparison charts and runs table drawn (bench/dashboard_bench.py).
    performance.mark("plab:first-render");
    state.firstRenderMs = performance.now();
    document.dispatchEvent(new Event("plab:first-render"));
  }
  if (needsPerfSeries()) {
    // Throughput/memory curves only feed the bars (a median) of runs whose worker has not sent its final
    // summary yet: a few hundred points are plenty, fetched after the loss curves are on screen.
    state.perf = await fetchSeries(PERF_KEYS, 200, { withZoom: false }).catch(() => state.perf);
    renderTable();
    drawSpeed();
  } else {
    state.perf = new Map();
  }
}

function needsPerfSeries() {
  return state.runs.some((r) => LIVE_STATUSES.has(r.status) || tokensPerSecond(r) == null);
}

function orderRuns(runs) {
  // Baseline first so it keeps the same colour and legend slot on every chart.
  return runs.slice().sort((a, b) => {
    const ba = recipeName(a) === BASELINE ? 0 : 1, bb = recipeName(b) === BASELINE ? 0 : 1;
    return ba - bb || String(a.id).localeCompare(String(b.id), undefined, { numeric: true });
  });
}

function baselineRun() {
  // The API's choice (the comparison's and the verdict's baseline run) once it is known.
  const chosen = state.comparison && state.runs.find((r) => String(r.id) === String(state.comparison.baseline_run_id));
  if (chosen) return chosen;
  const base = state.runs.filter((r) => recipeName(r) === BASELINE);
  return base.find((r) => r.status === "succeeded") || base.find((r) => r.status === "running") || base[0] || null;
}

// BF16's seed replicates in shades of grey (the first, the reference, black): one colour made three seeds one line.
const BASELINE_SHADES = [BASELINE_COLOR, "#5c5c5c", "#8f8f8f", "#b4b4b4"];

function colorOf(run, index) {
  if (recipeName(run) !== BASELINE) return colorAt(index);
  const k = state.runs.filter((r) => recipeName(r) === BASELINE).findIndex((r) => r.id === run.id);
  return BASELINE_SHADES[Math.max(k, 0) % BASELINE_SHADES.length];
}

function pointsOf(run, key, source = state.series) {
  const s = (source.get(String(run.id)) || {})[key];
  if (!s) return { step: [], tokens: [], wall_time: [], value: [] };
  return { step: s.step || [], tokens: s.tokens || [], wall_time: s.wall_time || [], value: s.value || [] };
}

function xValues(points) {
  if (state.xMode === "wall_time") return relativeWallTime(points.wall_time);
  return state.xMode === "tokens" ? points.tokens : points.step;
}

// ---------------------------------------------------------------- charts
// A chart with nothing to show says why instead of drawing empty axes.
function emptyNote(hasData, text) {
  return hasData ? [] : [{ text, xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false,
    font: { size: 13, color: "#667085" } }];
}

function lossLayout(title, yTitle) {
  return {
    title: { text: title, font: { size: 14 } },
    margin: { l: 60, r: 20, t: 40, b: 45 },
    xaxis: { title: { text: X_TITLES[state.xMode], standoff: 6 }, automargin: true },
    yaxis: { title: { text: yTitle }, type: state.logScale ? "log" : "linear" },
    hovermode: "x unified",
    legend: BOTTOM_LEGEND,
    // Keeps the user's zoom across the 2 s live updates; changes when the axis meaning changes.
    uirevision: `${state.xMode}|${state.logScale}`,
  };
}

function lossTraces(key, smoothing) {
  return state.runs.flatMap((run, i) => {
    const p = pointsOf(run, key);
    return smoothedTraces({ name: plotText(runLabel(run)), x: xValues(p), y: p.value, color: colorOf(run, i),
      width: recipeName(run) === BASELINE ? 2.5 : 1.6, smoothing, meta: { run_id: run.id, key } }, ema);
  });
}

let zoomAttached = false;
function drawLoss() {
  const traces = lossTraces("train/loss", state.smoothing);
  const layout = lossLayout("Training loss", "train/loss (nats/token)");
  layout.annotations = emptyNote(traces.some((t) => t.x.length), !state.runs.length ? "this experiment has no runs"
    : isLive() ? "no train/loss points yet: curves appear as runs report them"
      : "no train/loss points: the runs ended without reporting any");
  Plotly.react("loss-chart", traces, layout, PLOT_CONFIG);
  // Zoom re-queries from the moment the chart exists (not after the rest of the page's first load).
  if (!zoomAttached && document.getElementById("loss-chart").on) { attachZoom(); zoomAttached = true; }
  const hasVal = state.runs.some((run) => pointsOf(run, "val/loss").value.length > 0);
  const valDiv = document.getElementById("val-loss-chart");
  valDiv.hidden = !hasVal;
  if (hasVal) {
    const traces = lossTraces("val/loss", 0).map((t) => ({ ...t, mode: "lines+markers", marker: { size: 4 } }));
    Plotly.react(valDiv, traces, lossLayout("Validation loss", "val/loss (nats/token)"), PLOT_CONFIG);
  }
}

function drawRelative() {
  const cmp = state.comparison;
  const entries = new Map((cmp?.runs || []).map((e) => [String(e.run_id), e]));
  // The API's baseline run (the verdict's): a succeeded BF16 run with no layer kept apart, else the earliest.
  const base = cmp ? baselineRun() : null;
  const others = state.runs.filter((r) => r !== base && recipeName(r) !== BASELINE);
  const useTokens = cmp?.x === "tokens";
  const diffOf = (run) => {
    const e = entries.get(String(run.id));
    return e ? { x: e.x || [], y: e.delta_pct || [] } : { x: [], y: [] };
  };
  const traces = others.map((run) => {
    const idx = state.runs.indexOf(run);
    const diff = diffOf(run);
    // Smooth the difference, not the two losses: an EMA runs over points, so two runs sampled on
    // different token grids would lag differently and show a difference that is not there.
    return smoothedTraces({ name: plotText(runLabel(run)), x: diff.x, y: diff.y, color: colorOf(run, idx),
      smoothing: state.smoothing, meta: { run_id: run.id, key: "relative" } }, ema);
  }).flat();
  // BF16's seed replicates draw its seed band; with one seed, the experiment's stated tolerance is the band.
  // The experiment's own BF16 runs (a record-only one is a seed only where every BF16 run is: the API's rule).
  const bf16 = state.runs.filter((r) => recipeName(r) === BASELINE && !r.bf16_first_layers && !r.bf16_last_layers);
  const own = bf16.filter((r) => !r.external);
  const replicates = (own.length ? own : bf16).filter((r) => r !== base);
  const smooth = (y) => (state.smoothing > 0 ? ema(y, state.smoothing) : y);
  const band = base ? seedBandTraces(replicates.map(diffOf), smooth) : [];
  const tol = state.experiment?.verdict_tolerance_pct ?? 1;
  const layout = {
    title: { text: base ? "Train loss difference to BF16 (%)" : "No BF16 run to compare with", font: { size: 14 } },
    margin: { l: 60, r: 20, t: 40, b: 45 },
    xaxis: { title: { text: useTokens ? "tokens" : "step", standoff: 6 }, automargin: true },
    yaxis: { title: { text: "Δ loss vs BF16 (%)" }, zeroline: true },
    hovermode: "x unified",
    legend: BOTTOM_LEGEND,
    annotations: [...emptyNote(traces.some((t) => t.x.length), base
      ? "no comparable points yet (needs a BF16 run and another recipe with train/loss)"
      : "no BF16 run in this experiment"),
    // The shaded band says what it is: the verdict's tolerance, which it applies to the final validation loss (this
    // chart is the training loss, so a curve may leave the band where the verdict still says "matches").
    ...(band.length || !traces.some((t) => t.x.length) ? [] : [{ xref: "paper", x: 0, xanchor: "left", yref: "y",
      y: tol, yanchor: "bottom", showarrow: false, font: { size: 11, color: "#2c7a2c" },
      text: `±${tol}%: the verdict's tolerance, on final validation loss` }])],
    shapes: band.length ? [] : [{ type: "rect", xref: "paper", x0: 0, x1: 1, yref: "y", y0: -tol, y1: tol,
      fillcolor: "rgba(44,160,44,0.12)", line: { width: 0 }, layer: "below" }],
    uirevision: `rel|${useTokens}`,
  };
  Plotly.react("relative-chart", [...band, ...traces], layout, PLOT_CONFIG);
  collapsePanel("relative-chart", traces.some((t) => t.x.length) ? "" : layout.annotations[0]?.text);
}

function runThroughput(run) {
  const fromSummary = tokensPerSecond(run);
  if (fromSummary != null) return fromSummary;
  // Live runs have no summary yet: the median of the logged tokens/s skips compile and warm-up outliers.
  return median(pointsOf(run, "perf/tokens_per_s", state.perf).value);
}

function drawSpeed() {
  // The speedups are the API's (the comparison's, by the verdict's rule): tokens/s over the mean of the BF16
  // replicates' on the same device; none across two kinds of device.
  const speedOf = new Map((state.comparison?.runs || []).map((r) => [String(r.run_id), r]));
  const labels = [], tps = [], text = [], notes = [], emulatedBars = [], colors = [], mem = [], mfus = [];
  state.runs.forEach((run, i) => {
    const emulated = gemmBackend(run) === "emulated";
    labels.push(plotText(runLabel(run) + (emulated ? " (emulated)" : "")));
    const t = runThroughput(run);
    tps.push(t);
    const cmp = speedOf.get(String(run.id));
    text.push(typeof cmp?.speedup === "number" ? `${cmp.speedup.toFixed(2)}×` : "");
    notes.push(plotText(typeof cmp?.speedup === "number" ? `${cmp.speedup.toFixed(2)}× BF16`
      : (t != null && cmp?.speedup_note) || ""));
    emulatedBars.push(emulated);
    colors.push(colorOf(run, i));
    mem.push(peakMemory(run) ?? median(pointsOf(run, "perf/peak_mem_gib", state.perf).value));
    const m = mfu(run) ?? median(pointsOf(run, "perf/mfu", state.perf).value);
    mfus.push(mfuPercent(m));
  });
  Plotly.react("throughput-chart", [{
    type: "bar", x: labels, y: tps, text, customdata: notes, textposition: "outside", name: "tokens/s",
    marker: { color: colors, pattern: emulatedPattern(emulatedBars) },
    hovertemplate: "%{x}<br>%{y:,.0f} tokens/s<br>%{customdata}<extra></extra>",
  }], {
    // Two lines: the whole title stays readable on a phone.
    title: { text: "Throughput (tokens/s of a run, all its devices)<br><sub>label: speedup over BF16 on the same device</sub>",
      font: { size: 14 } },
    margin: { l: 70, r: 20, t: 55, b: 90 }, yaxis: { title: { text: "tokens/s" } }, showlegend: false,
    xaxis: { automargin: true }, // "nvfp4 (emulated)" whole on a phone
    annotations: emptyNote(tps.some((v) => v != null), "no throughput reported yet"),
  }, PLOT_CONFIG);
  // CPU runs report no peak memory or MFU: the chart is left out rather than drawn empty beside the throughput.
  const memDiv = document.getElementById("memory-chart");
  const hasMem = mem.some((v) => v != null) || mfus.some((v) => v != null);
  const wasHidden = memDiv.hidden;
  memDiv.hidden = !hasMem;
  if (hasMem) Plotly.react("memory-chart", [
    { type: "bar", x: labels, y: mem, name: "peak memory (GiB)", offsetgroup: "mem",
      marker: { color: "#6c8ebf", pattern: emulatedPattern(emulatedBars) } },
    { type: "bar", x: labels, y: mfus, name: "MFU (% of dense BF16 peak)", yaxis: "y2", offsetgroup: "mfu",
      marker: { color: "#d79b00", pattern: emulatedPattern(emulatedBars) },
      hovertemplate: "%{x}<br>MFU %{y:.1f}% of the GPU's dense BF16 peak<extra></extra>" },
  ], {
    title: { text: "Peak memory and MFU", font: { size: 14 } },
    margin: { l: 60, r: 60, t: 40, b: 90 }, barmode: "group", xaxis: { automargin: true },
    yaxis: { title: { text: "GiB" } },
    yaxis2: { title: { text: "MFU %" }, overlaying: "y", side: "right", rangemode: "tozero" },
    legend: { orientation: "h", y: 1.12 },
  }, PLOT_CONFIG);
  if (hasMem && wasHidden) Plotly.Plots.resize(memDiv);
  // How MFU is computed is said only where an MFU is shown (a CPU-only experiment has none).
  document.getElementById("mfu-convention").hidden = !mfus.some((v) => v != null);
  const anySpeed = tps.some((v) => v != null) || mem.some((v) => v != null) || mfus.some((v) => v != null);
  collapsePanel("throughput-chart", anySpeed ? "" : "No throughput, memory or MFU reported yet.");
}

// ---------------------------------------------------------------- numerics heatmap
const NUMERICS_REFRESH_MS = 10_000;
const numerics = { runId: null, stat: "underflow_frac", keysByRun: new Map(), fetchedAt: 0, loading: false };

function syncNumericsRuns() {
  const select = document.getElementById("numerics-run");
  const candidates = state.runs.filter((r) => recipeName(r) !== BASELINE);
  const wanted = candidates.map((r) => String(r.id)).join(",");
  if (select.dataset.runs !== wanted) {
    setHTML(select, joinHtml(candidates.map((r) => html`<option value="${r.id}">${runLabel(r)}</option>`)));
    select.dataset.runs = wanted;
    if (numerics.runId && candidates.some((r) => String(r.id) === numerics.runId)) select.value = numerics.runId;
  }
  numerics.runId = select.value || null;
}

async function drawNumerics({ force = false } = {}) {
  if (!window.Plotly) return;
  syncNumericsRuns();
  const run = state.runs.find((r) => String(r.id) === numerics.runId);
  const live = run && LIVE_STATUSES.has(run.status);
  const stale = Date.now() - numerics.fetchedAt > NUMERICS_REFRESH_MS;
  if (!force && (numerics.loading || (numerics.fetchedAt && !(live && stale)))) return;
  numerics.loading = true;
  try {
    let layers = [], steps = [], z = [];
    if (run) {
      // Every layer in one request (GET /runs/{id}/numerics), already in layer order.
      const answer = await get(`/api/v1/runs/${encodeURIComponent(run.id)}/numerics?${new URLSearchParams(
        { stat: numerics.stat, max_points: "300" })}`);
      const series = answer.layers || [];
      layers = series.map((s) => s.layer);
      steps = [...new Set(series.flatMap((s) => s.step || []))].sort((a, b) => a - b);
      const column = new Map(steps.map((st, i) => [st, i]));
      z = series.map((s) => {
        const rowValues = new Array(steps.length).fill(null);
        (s.step || []).forEach((st, i) => { rowValues[column.get(st)] = s.value[i]; });
        return rowValues;
      });
    }
    numerics.fetchedAt = Date.now();
    const isSnr = numerics.stat === "snr_db";
    const zmax = Math.max(0, ...z.flat().filter((v) => v != null && Number.isFinite(v)));
    // Fractions start at 0 = pale (plotly's YlOrRd runs dark → pale, hence reversed); SNR: brighter is better.
    const scale = isSnr ? { colorscale: "Viridis" }
      : { colorscale: "YlOrRd", reversescale: true, zmin: 0, zmax: zmax > 0 ? zmax : 1 };
    Plotly.react("numerics-chart", [{
      type: "heatmap", x: steps, y: layers.map(plotText), z, ...scale,
      hoverongaps: false, colorbar: { title: { text: isSnr ? "dB" : "fraction" } },
      hovertemplate: "%{y}<br>step %{x}<br>%{z:.3g}<extra></extra>",
    }], {
      title: { text: run ? plotText(`${runLabel(run)}: ${numerics.stat} per layer`) : "", font: { size: 14 } },
      margin: { l: 220, r: 20, t: 40, b: 45 },
      xaxis: { title: { text: "step" } },
      yaxis: { automargin: true, autorange: "reversed", tickfont: { size: 10 } },
      annotations: emptyNote(layers.length > 0, run
        ? "no numerics logged for this run (set training.numerics_every in the spec)"
        : "no low-precision run in this experiment"),
    }, PLOT_CONFIG);
    // Collapsed to one line when empty; the run selector stays, another run may have numerics.
    collapsePanel("numerics-chart", layers.length ? "" : (run
      ? `No numerics logged for ${runLabel(run)} (set training.numerics_every in the spec).`
      : "No low-precision run in this experiment: nothing to show."), { keepControls: Boolean(run) });
  } finally {
    numerics.loading = false;
  }
}

// ---------------------------------------------------------------- page text and table
// The experiment's model: what its spec names (a preset, custom dims, a config.json or a checkpoint folder) and,
// once a run has built it, the architecture and parameter count it reported (summary.model).
function describeModel(model, runs = []) {
  const built = runs.map((run) => runSummary(run).model).find((m) => m && typeof m === "object");
  const named = describeModelSpec(model);
  if (!built) return named;
  const params = Number.isFinite(built.params) ? ` · ${formatParams(built.params)} parameters` : "";
  return `${built.architecture || "model"}${params} · ${named}`;
}

// The val loss's windows: how many and where (data.val_windows), as a run reports them when it starts
// (summary.validation, from its run_info); before any run has started, the rule alone.
function describeValidation(data, runs = []) {
  const how = (rule) => (rule === "first" ? "the first in a row" : "spread evenly");
  const v = runs.map((run) => runSummary(run).validation).find((x) => x && typeof x === "object");
  if (!v || !Number.isFinite(v.windows)) return `windows of the held-out split, ${how(data.val_windows || "spread")}`;
  const n = (x) => x.toLocaleString("en-US");
  const of = Number.isFinite(v.split_windows) ? ` of the held-out split's ${n(v.split_windows)}` : "";
  const tokens = Number.isFinite(v.tokens) ? ` (${n(v.tokens)} tokens)` : "";
  return `${n(v.windows)}${of} windows${tokens}, ${how(v.rule)}`;
}

function formatParams(n) {
  for (const [div, unit] of [[1e9, "B"], [1e6, "M"], [1e3, "k"]]) {
    if (n >= div) return `${(n / div).toFixed(n >= 10 * div ? 0 : 1)}${unit}`;
  }
  return String(n);
}

function describeModelSpec(model) {
  if (typeof model === "string") return `preset ${model}`;
  if (!model || typeof model !== "object") return "";
  if (typeof model.config === "string") return `random init from config ${model.config}`;
  if (typeof model.init_from === "string") return `from checkpoint ${model.init_from}`;
  const dims = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size"].filter((k) => model[k] != null).map((k) => `${k}=${model[k]}`);
  return `custom (${dims.join(", ")})`;
}

function renderHeader() {
  const exp = state.experiment;
  document.getElementById("experiment-name").textContent = exp.name || `Experiment ${experimentId}`;
  document.title = `${exp.name || "Experiment"} · Precision Lab`;
  setHTML(document.getElementById("experiment-description"), renderMarkdown(exp.description || ""));
  housekeeping.update(exp);
  const data = exp.data || {}, training = exp.training || {};
  const evalTasks = Array.isArray(exp.eval_tasks) ? exp.eval_tasks.join(", ") : "";
  const entries = [
    ["model", describeModel(exp.model, state.runs)],
    ["corpus", data.corpus],
    ["budget", training.steps != null ? `${training.steps} steps` : (training.tokens != null ? `${training.tokens} tokens` : "")],
    ["batch × seq", training.batch_size != null ? `${training.batch_size} × ${data.seq_len ?? "?"}` : ""],
    ["learning rate", training.lr],
    ["validation", describeValidation(data, state.runs)],
    ["seed", exp.seed],
    ["eval tasks", evalTasks],
    ["created", formatDate(exp.created_at)],
  ].filter(([, v]) => v !== undefined && v !== null && v !== "");
  setHTML(document.getElementById("experiment-meta"),
    joinHtml(entries.map(([k, v]) => html`<div><dt>${k}</dt><dd>${v}</dd></div>`)));
}

function eta(run, fraction) {
  if (run.status !== "running" || !fraction || fraction >= 1 || !run.started_at) return "";
  const started = new Date(run.started_at).getTime();
  if (Number.isNaN(started)) return "";
  const elapsed = (Date.now() - started) / 1000;
  const left = (elapsed * (1 - fraction)) / fraction;
  if (!Number.isFinite(left) || left < 0) return "";
  return left < 90 ? `${Math.round(left)} s left` : `${Math.round(left / 60)} min left`;
}

function gemmLabel(run) {
  const backend = gemmBackend(run);
  if (!backend) return "";
  const title = backend === "emulated"
    ? "quantize → dequantize → BF16 GEMM: accuracy is the format's, throughput is not"
    : backend === "real" ? "low-precision tensor-core kernels" : "BF16 GEMMs";
  return html`<span class="gemm gemm-${backend}" title="${title}">${backend}</span>`;
}

// Total optimizer steps of the experiment's budget, to estimate progress of a run that reports none.
function budgetSteps() {
  const t = state.experiment?.training || {}, d = state.experiment?.data || {};
  if (t.steps) return t.steps;
  const perStep = (t.batch_size || 0) * (t.grad_accum || 1) * (d.seq_len || 0);
  return t.tokens && perStep ? Math.ceil(t.tokens / perStep) : null;
}

function lastLoggedStep(run) {
  let last = null;
  for (const [source, key] of [[state.series, "train/loss"], [state.perf, "perf/tokens_per_s"]]) {
    const steps = pointsOf(run, key, source).step;
    if (steps.length) last = Math.max(last ?? 0, steps[steps.length - 1]);
  }
  return last;
}

function runProgress(run) {
  const reported = progressFraction(run);
  if (reported != null || run.status !== "running") return reported;
  const total = budgetSteps(), last = lastLoggedStep(run);
  // Steps are 0-based in the metric stream, so the last logged step s means s + 1 steps done.
  return total && last != null ? Math.min(1, (last + 1) / total) : null;
}

function progressCell(run) {
  const preparing = dataPreparation(run);
  if (preparing) {
    const pct = preparing.fraction == null ? null : Math.round(preparing.fraction * 100);
    return html`<td class="progress-cell preparing-data">${pct != null && html`<div class="progress" title="${pct}%">
        <div class="progress-bar" style="width:${pct}%"></div></div>`}
        <span class="progress-text data-progress">${preparing.text}</span></td>`;
  }
  const fraction = runProgress(run);
  const pct = fraction == null ? null : Math.round(fraction * 100);
  return html`<td class="progress-cell">${pct != null && html`<div class="progress" title="${pct}%">
        <div class="progress-bar" style="width:${pct}%"></div></div>
        <span class="progress-text">${pct}%</span> <span class="eta">${eta(run, fraction)}</span>`}</td>`;
}

function runRow(run, i) {
  const loss = finalLoss(run);
  const tps = runThroughput(run);
  const message = [
    run.status === "diverged" && run.diverged_step != null ? `diverged at step ${run.diverged_step}` : "",
    run.error_message || "", slurmNote(run),
  ].filter(Boolean).join(": ");
  const device = [run.device_name, run.worker_host].filter(Boolean).join(" @ ");
  const live = LIVE_STATUSES.has(run.status) && !run.external;
  const data = dataSummary(run);
  return html`<tr data-run-id="${run.id}" data-status="${run.status}">
    <td><span class="swatch" style="background:${colorOf(run, i)}"></span><a class="run-link"
      href="${urlPath("runs", run.id)}">${runLabel(run)}</a>${run.external
      && html` <span class="badge record-only" title="logged by the user's script through the API, not trained by a worker: not polled">record-only</span>`}${data && html`
        <div class="muted run-data">${data}</div>`}</td>
    <td>${statusBadge(run.status)}</td>
    ${progressCell(run)}
    <td>${device}</td>
    <td>${gemmLabel(run)}</td>
    <td class="num">${loss == null ? "" : loss.toFixed(4)}</td>
    <td class="num">${tps == null ? "" : Math.round(tps).toLocaleString()}</td>
    <td class="run-message">${message}</td>
    <td>${live && (run.cancel_requested
      ? html`<span class="muted cancelling" title="the worker stops at the next step boundary">cancelling…</span>`
      : html`<button type="button" class="cancel-run" data-run-id="${run.id}">Cancel</button>`)}</td>
  </tr>`;
}

function renderTable() {
  setHTML(document.getElementById("runs-body"), state.runs.length
    ? joinHtml(state.runs.map(runRow))
    : html`<tr class="placeholder"><td colspan="9">This experiment has no runs.</td></tr>`);
}

function drawCharts() {
  drawLoss();
  drawRelative();
  drawSpeed();
  drawNumerics().catch((err) => showGlobalError(`Numerics: ${err.message}`));
}

// ---------------------------------------------------------------- live updates
function isLive() {
  return liveRuns(state.runs).length > 0;
}

function setLiveStatus(polling, note = "") {
  const el = document.getElementById("live-status");
  el.dataset.polling = String(polling);
  el.textContent = note || statusLine(state.runs, polling, state.workerNote);
  el.dataset.state = note ? "note" : (polling ? "live" : "done");
}

// The runs panel (header, runs table, loss, comparison and speed charts) in the page's one poller: polled while
// any run can still change; a failed request (server restarting) also retries, a 404 ends it.
async function refreshRuns() {
  state.polls += 1;
  state.failed = false;
  try {
    await refresh();
    state.workerNote = await workerNote(state.experiment, state.runs);
    showGlobalError("");
  } catch (err) {
    state.failed = err.status !== 404;
    showGlobalError(`Could not load experiment ${experimentId}: ${err.message}`);
    if (err.status === 404) { state.gone = true; setLiveStatus(false, "not found"); return; }
  }
  setLiveStatus(isLive() || state.failed);
}

function refreshSoon() {
  poke();
}

// ---------------------------------------------------------------- controls
document.getElementById("x-axis").addEventListener("change", (event) => {
  state.xMode = event.target.value;
  state.zoom = null;
  refreshSoon();
});
document.getElementById("smoothing").addEventListener("input", (event) => {
  state.smoothing = Number(event.target.value);
  document.getElementById("smoothing-value").textContent = state.smoothing.toFixed(2);
  if (state.experiment && window.Plotly) { drawLoss(); drawRelative(); }
});
document.getElementById("log-scale").addEventListener("change", (event) => {
  state.logScale = event.target.checked;
  if (state.experiment && window.Plotly) drawLoss();
});
for (const id of ["numerics-run", "numerics-stat"]) {
  document.getElementById(id).addEventListener("change", () => {
    numerics.runId = document.getElementById("numerics-run").value || null;
    numerics.stat = document.getElementById("numerics-stat").value;
    drawNumerics({ force: true }).catch((err) => showGlobalError(`Numerics: ${err.message}`));
  });
}
document.getElementById("runs-body").addEventListener("click", async (event) => {
  const button = event.target.closest("button.cancel-run");
  if (!button) return;
  const run = state.runs.find((r) => String(r.id) === button.dataset.runId);
  if (!window.confirm(`Cancel ${run ? runLabel(run) : `run ${button.dataset.runId}`}? A running job stops at its next `
    + "step; a queued one never starts.")) return;
  button.disabled = true;
  try {
    await post(`/api/v1/runs/${encodeURIComponent(button.dataset.runId)}/cancel`);
    showGlobalError("");
  } catch (err) {
    showGlobalError(`Cancel failed: ${err.message}`);
  }
  refreshSoon();
});

function attachZoom() {
  const chart = document.getElementById("loss-chart");
  chart.on("plotly_relayout", (ev) => {
    // Wall time is shown relative to each run's start, which the server cannot filter on.
    if (state.xMode === "wall_time") return;
    let zoom = state.zoom;
    if (ev["xaxis.autorange"]) zoom = null;
    else if (ev["xaxis.range[0]"] !== undefined) zoom = [ev["xaxis.range[0]"], ev["xaxis.range[1]"]];
    else if (Array.isArray(ev["xaxis.range"])) zoom = ev["xaxis.range"];
    else return;
    if (JSON.stringify(zoom) === JSON.stringify(state.zoom)) return;
    // Re-query the zoomed window so the server's downsampling spends its points where the user looks.
    state.zoom = zoom;
    fetchLossSeries().then((loss) => {
      if (!loss.latest) return;
      state.series = loss.series;
      drawLoss();
    }).catch((err) => showGlobalError(err.message));
  });
}

// ---------------------------------------------------------------- start
const mfuConvention = document.getElementById("mfu-convention");
mfuConvention.textContent = `MFU: ${MFU_CONVENTION.replace(/^Model FLOPs utilization: /, "")}.`;
mfuConvention.hidden = true; // until a run with an MFU is drawn (drawSpeed)
register({ name: "runs", refresh: refreshRuns, live: () => !state.gone && (isLive() || state.failed) });
mountVerdict();
mountGemm();
mountAccuracy();
// ---- pages helper
const housekeeping = mountHousekeeping(document.getElementById("experiment-housekeeping"), {
  kind: "experiments", nameField: "name", hasDescription: true, describe: (e) => `experiment "${e.name}"`,
  onSaved: (saved) => { state.experiment = { ...state.experiment, ...saved }; renderHeader(); },
  onDeleted: () => { window.location.assign("/"); },
});
mountExplorer(experimentId);
mountExport(experimentId, () => state.experiment, showGlobalError);
// ---- end pages helper
// Tests and curious users can read the page's state from the console.
window.plabExperiment = state;
