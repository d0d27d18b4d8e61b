// GEMM panel of the experiment page: the experiment's GEMM benchmarks from /api/v1/gemm-benchmarks,
// drawn as grouped bars of speedup over BF16 per layer × pass × format (kernel-only and with quantization), a
// table of the shapes, and the predicted end-to-end speedup next to the one the experiment's training runs
// measured on the benchmark's device (tokens/s of the recipe's run / the mean of BF16's runs' there). Formats
// without hardware support on the benchmark's
// device ran emulated: their bars are hatched and their names say so, because their timings are not what
// the format's hardware would give.
import { get, items, formatDate, LIVE_STATUSES } from "../api.js";
import { BOTTOM_LEGEND, colorAt, emulatedPattern, PLOT_CONFIG, plotlyReady } from "../plot.js";
import { register } from "../poller.js";
import { html, joinHtml, plotText, setHTML, statusBadge } from "../dom.js";
import { BASELINE, gemmBackend, recipeName, runLabel, tokensPerSecond } from "../summary.js";

const root = document.getElementById("experiment-root");
const experimentId = root.dataset.experimentId;
const panel = document.getElementById("gemm-panel");
const EVERY_MS = 5000; // a benchmark takes minutes: this panel is refreshed every 5 s, not 2
const LAYER_ORDER = ["qkv", "attn_out", "mlp_up", "mlp_down", "lm_head", "custom"];
const PASS_ORDER = ["fprop", "dgrad", "wgrad"];
const MODES = [
  { key: "kernel", chart: "gemm-chart-kernel", title: "kernel-only (operands quantized beforehand)" },
  { key: "quant", chart: "gemm-chart-quant", title: "with quantization (quantize kernels timed, as in training)" },
];
const EMULATED = "emulated – no hardware support";
// torch's own FP8 GEMM on a CPU (`backend: "cpu"`): FP8 arithmetic in software, as far from FP8 hardware as an
// emulation, and training on a CPU labels the same recipe emulated.
const CPU_KERNEL = "CPU kernel – no FP8 hardware";

// `refreshes` counts completed loads (tests wait on it).
export const gemmState = { list: [], selectedId: null, detail: null, experiment: null, runs: [], drawn: false, refreshes: 0 };
window.plabGemm = gemmState;

// ---------------------------------------------------------------- reading a result
function fmt(x, digits = 2) {
  return typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : "–";
}

// TFLOP/s span 0.001 (a tiny GEMM timed on a CPU) to 2000 (FP4 on a B200): three significant digits.
function tflops(x) {
  return typeof x === "number" && Number.isFinite(x) ? x.toPrecision(3) : "–";
}

function gemmKey(r) {
  return `${r.layer}.${r.gemm}`;
}

function orderShapes(shapes) {
  const rank = (list, v) => { const i = list.indexOf(v); return i < 0 ? list.length : i; };
  return [...shapes].sort((a, b) => rank(LAYER_ORDER, a.layer) - rank(LAYER_ORDER, b.layer)
    || rank(PASS_ORDER, a.gemm) - rank(PASS_ORDER, b.gemm) || a.m - b.m || a.k - b.k || a.n - b.n);
}

// Formats whose timings are not a hardware kernel's, each with what it ran: the emulation path when any of its
// timings did (no kernel for it on that device), else torch's CPU kernel. Hatched and labelled everywhere.
export function emulatedFormats(result) {
  const out = new Map();
  for (const r of result.results || []) {
    if (r.backend === "emulated") out.set(r.format, EMULATED);
    else if (r.backend === "cpu" && !out.has(r.format)) out.set(r.format, CPU_KERNEL);
  }
  return out;
}

function formatLabel(format, emulated) {
  return emulated.has(format) ? `${format} (${emulated.get(format)})` : format;
}

function recordIndex(result) {
  const index = new Map();
  for (const r of result.results || []) {
    index.set(`${r.format}|${r.format === BASELINE ? "both" : r.mode}|${r.layer}|${r.gemm}|${r.m}x${r.k}x${r.n}`, r);
  }
  return (format, mode, s) => index.get(
    `${format}|${format === BASELINE ? "both" : mode}|${s.layer}|${s.gemm}|${s.m}x${s.k}x${s.n}`);
}

// ---------------------------------------------------------------- drawing
function drawBars(result) {
  const emulated = emulatedFormats(result);
  const shapes = orderShapes(result.shapes || []);
  const lookup = recordIndex(result);
  const categories = shapes.map((s) => plotText(s.layer === "custom" ? `${s.m}x${s.k}x${s.n}` : gemmKey(s)));
  const formats = (result.formats || []).filter((f) => f !== BASELINE);
  for (const mode of MODES) {
    const el = document.getElementById(mode.chart);
    if (!(result.modes || []).includes(mode.key)) {
      el.hidden = true;
      continue;
    }
    el.hidden = false;
    const traces = formats.map((format) => {
      const recs = shapes.map((s) => lookup(format, mode.key, s));
      return {
        type: "bar", name: plotText(formatLabel(format, emulated)), x: categories,
        y: recs.map((r) => r?.speedup_vs_bf16 ?? null),
        text: recs.map((r) => (typeof r?.speedup_vs_bf16 === "number" ? `${r.speedup_vs_bf16.toFixed(2)}×`
          : plotText(r?.check || ""))),
        customdata: recs.map((r) => [r?.tflops ?? null, plotText(r?.backend ?? ""), plotText(r?.note ?? "")]),
        hovertemplate: `${plotText(format)}<br>%{x}: %{y:.2f}× BF16<br>%{customdata[0]:.1f} TFLOP/s`
          + "<br>%{customdata[1]} %{customdata[2]}<extra></extra>",
        marker: { color: colorAt((result.formats || []).indexOf(format)),
          pattern: emulatedPattern(emulated.has(format)) },
        meta: { format, mode: mode.key, emulated: emulated.has(format) },
      };
    });
    window.Plotly.react(el, traces, {
      // Two lines: on a phone the one-line title was cut at both ends.
      title: { text: `Speedup over BF16 per GEMM<br><sub>${mode.title}</sub>`, font: { size: 14 } },
      barmode: "group", margin: { l: 60, r: 20, t: 40, b: 90 },
      yaxis: { title: { text: "× BF16" }, rangemode: "tozero" },
      xaxis: { tickangle: -35, automargin: true },
      legend: BOTTOM_LEGEND,
      shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: 1, y1: 1, line: { dash: "dot", color: "#111" } }],
    }, PLOT_CONFIG);
  }
}

function renderShapes(result) {
  const emulated = emulatedFormats(result);
  const lookup = recordIndex(result);
  const formats = (result.formats || []).filter((f) => f !== BASELINE);
  const modes = result.modes || [];
  const head = document.querySelector("#gemm-shapes-table thead");
  const cols = [];
  for (const format of formats) for (const mode of modes) cols.push({ format, mode });
  setHTML(head, html`<tr><th>Layer</th><th>Pass</th><th>M × K × N</th><th>Count</th><th>BF16 TFLOP/s</th>${
    cols.map((c) => html`<th class="${emulated.has(c.format) ? "gemm-emulated" : ""}" title="${
      emulated.get(c.format) || ""}">${c.format}${emulated.has(c.format) ? "*" : ""}<br>${
      c.mode === "kernel" ? "kernel-only" : "with quant."}</th>`)}</tr>`);
  const body = document.querySelector("#gemm-shapes-table tbody");
  setHTML(body, joinHtml(orderShapes(result.shapes || []).map((s) => {
    const base = lookup(BASELINE, "both", s);
    const cells = cols.map((c) => {
      const r = lookup(c.format, c.mode, s);
      const text = typeof r?.speedup_vs_bf16 === "number" ? `${r.speedup_vs_bf16.toFixed(2)}×` : (r?.check || "–");
      const failed = r && (r.check === "fail" || r.check === "error");
      return html`<td class="num${emulated.has(c.format) ? " emulated" : ""}${failed ? " check-failed" : ""}" ${""
        }data-format="${c.format}" data-mode="${c.mode}" title="${r?.note || ""}">${text}</td>`;
    });
    return joinHtml([html`<tr data-layer="${s.layer}" data-gemm="${s.gemm}"><td>${s.layer}</td><td>${s.gemm}</td>`,
      html`<td class="num shape-dims">${s.m} × ${s.k} × ${s.n}</td><td class="num">${s.count}</td>`,
      html`<td class="num">${tflops(base?.tflops)}</td>${cells}</tr>`]);
  })));
}

// The experiment's finished BF16 baseline runs (no layer kept apart) on `device` (any device when the benchmark
// does not name one): the verdict's rule for a speedup (training/evaluation/verdict.py `speedups`) restricted
// to the benchmark's device, so what is measured sits next to what is predicted for the same GPU.
const onDevice = (r, device) => !device || !r.device_name || r.device_name === device;

function bf16Runs(runs, device) {
  return runs.filter((r) => recipeName(r) === BASELINE && !r.bf16_first_layers && !r.bf16_last_layers
    && r.status === "succeeded" && onDevice(r, device));
}

// Measured end-to-end speedup of a recipe on the benchmark's device: each finished run's tokens/s over the mean
// of the finished BF16 runs' there.
export function measuredSpeedups(runs, format, device = null) {
  const tps = bf16Runs(runs, device).map(tokensPerSecond).filter((v) => v != null);
  const baseTps = tps.length ? tps.reduce((a, b) => a + b, 0) / tps.length : null;
  if (!baseTps) return [];
  return runs.filter((r) => recipeName(r) === format && r.status === "succeeded" && tokensPerSecond(r) != null
    && onDevice(r, device))
    .map((r) => ({ label: runLabel(r), speedup: tokensPerSecond(r) / baseTps, emulated: gemmBackend(r) === "emulated" }));
}

function sameDims(a, b) {
  const keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"];
  const kv = (d) => d.num_key_value_heads ?? d.num_attention_heads;
  const hd = (d) => d.head_dim ?? d.hidden_size / d.num_attention_heads;
  return keys.every((k) => a[k] === b[k]) && kv(a) === kv(b) && hd(a) === hd(b);
}

// The finished BF16 run whose step the benchmark describes: same model, same micro-batch and sequence length,
// same device. Its measured step time turns the GEMM-only speedup into an Amdahl prediction (training.gemm.predict);
// anything else would mix two configurations. Returns {run, stepS, gemmsPerStep} or {why} when there is none.
export function bf16StepFor(result, experiment, runs) {
  const device = result.device?.name || "";
  const timed = bf16Runs(runs, null).filter((r) => r.summary?.step_time_s > 0);
  const base = timed.find((r) => (r.device_name || "") === device) || timed[0];
  const stepS = base?.summary?.step_time_s;
  if (!base || !(stepS > 0)) return { why: "no finished BF16 run with a step time in this experiment" };
  const req = result.request || {};
  const train = experiment.training || {};
  const accum = train.grad_accum || 1;
  const microBatch = (train.batch_size || 0) / (accum * (train.gpus || 1));
  const dims = result.config?.dims;
  const model = experiment.model;
  const sameModel = typeof model === "string"
    ? req.model === model && (req.vocab_size ?? 32000) === experiment.data?.vocab_size
    : Boolean(model && dims && sameDims(dims, model));
  if (!sameModel || req.micro_batch !== microBatch || req.seq_len !== experiment.data?.seq_len
      || (result.config?.gated_mlp === false)) {
    return { why: "the benchmark's model, micro-batch or sequence length differs from this experiment's" };
  }
  if ((base.device_name || "") !== (result.device?.name || "")) {
    return { why: `the BF16 run ran on ${base.device_name || "another device"}, the benchmark on ${result.device?.name}` };
  }
  return { run: base, stepS, gemmsPerStep: accum };
}

// predict_speedup of training/gemm/predict.py with the run's step: only the GEMM share of the step changes.
function amdahl(stepS, bf16GemmS, fmtGemmS) {
  if (!(bf16GemmS > 0) || !(fmtGemmS > 0) || bf16GemmS > stepS) return null;
  return { basis: "amdahl-run", speedup: stepS / (stepS - bf16GemmS + fmtGemmS), gemm_share: bf16GemmS / stepS };
}

function predictionCell(pred) {
  if (!pred) return "–";
  if (pred.speedup == null) return html`<span title="${pred.note || ""}">${pred.basis}</span>`;
  const share = `GEMM ${fmt(100 * pred.gemm_share, 1)}% of the BF16 step`;
  const basis = pred.basis === "amdahl" ? `Amdahl, ${share}`
    : pred.basis === "amdahl-run" ? `Amdahl with the BF16 run's step time, ${share}`
      : `GEMM-only: an upper bound${pred.why ? `; ${pred.why}` : ""}`;
  return html`${pred.speedup.toFixed(2)}× <span class="muted">(${basis})</span>`;
}

// The benchmark's own prediction when it was given a BF16 step time; else one from this experiment's BF16 run.
function predictionFor(result, format) {
  const mode = (result.modes || []).includes("quant") ? "quant" : "kernel";
  const own = result.prediction?.[mode]?.[format];
  if (own && own.basis !== "GEMM-only") return own;
  const step = gemmState.experiment ? bf16StepFor(result, gemmState.experiment, gemmState.runs) : { why: "" };
  if (step.run) {
    const totals = result.totals?.[mode] || {};
    // The figures training actually runs (LM head kept in BF16 by every recipe) when the result has them.
    const stepTotal = (t) => t?.training?.total_s ?? t?.total_s ?? 0;
    const pred = amdahl(step.stepS, step.gemmsPerStep * stepTotal(totals.bf16),
      step.gemmsPerStep * stepTotal(totals[format]));
    if (pred) return pred;
  }
  return own ? { ...own, why: step.why } : null;
}

function renderPrediction(result) {
  const emulated = emulatedFormats(result);
  const formats = (result.formats || []).filter((f) => f !== BASELINE);
  const totals = result.totals || {};
  const hasRuns = gemmState.runs.some((r) => r.status === "succeeded");
  const body = document.querySelector("#gemm-prediction-table tbody");
  document.getElementById("gemm-measured-head").hidden = !hasRuns;
  setHTML(body, joinHtml(formats.map((format) => {
    const measured = measuredSpeedups(gemmState.runs, format, result.device?.name || null);
    const measuredText = measured.length ? joinHtml(measured.map((m) => html`${m.speedup.toFixed(2)}×${
      measured.length > 1 && html` <span class="muted">${m.label}</span>`}${
      m.emulated && html` <span class="gemm gemm-emulated">emulated GEMMs</span>`}`), html`<br>`) : "–";
    return joinHtml([html`<tr data-format="${format}"><td>${formatLabel(format, emulated)}</td>`,
      html`<td class="num">${fmt(totals.kernel?.[format]?.speedup)}×</td>`,
      html`<td class="num">${fmt(totals.quant?.[format]?.speedup)}×</td>`,
      html`<td class="predicted">${predictionCell(predictionFor(result, format))}</td>`,
      hasRuns && html`<td class="measured num">${measuredText}</td>`, html`</tr>`]);
  })));
}

function renderMeta(bench) {
  const result = bench.result || {};
  const dev = result.device || {};
  const cfg = result.config || {};
  const what = cfg.dims ? `model ${cfg.model === "custom" ? "custom dims" : cfg.model}: hidden ${cfg.dims.hidden_size}, `
    + `${cfg.dims.num_hidden_layers} layers, micro-batch ${cfg.micro_batch} × seq ${cfg.seq_len}`
    + (cfg.gated_mlp === false ? ", plain (non-gated) MLP" : "") : "explicit GEMM shapes";
  const timer = dev.timer === "CPU" ? "CPU timings (wall clock): not indicative of GPU speedups" : `timer ${dev.timer || "?"}`;
  const byLabel = new Map();
  for (const [format, label] of emulatedFormats(result)) byLabel.set(label, [...(byLabel.get(label) || []), format]);
  const notes = [...byLabel].map(([label, formats]) => `${formats.join(", ")}: ${label}`);
  setHTML(document.getElementById("gemm-meta"), joinHtml([
    html`${statusBadge(bench.status)} <span id="gemm-device" data-device-type="${dev.type || ""}">`,
    html`${dev.name || bench.device_name || ""} (${dev.type || "?"}, ${timer})</span>`,
    html` · ${what} · ${formatDate(bench.created_at)}`,
    notes.length && html` · <span class="gemm gemm-emulated" id="gemm-emulated-note">${notes.join("; ")} on this ${""
      }device (hatched)</span>`]));
  const failures = result.failures || [];
  const fail = document.getElementById("gemm-failures");
  fail.hidden = !failures.length && !bench.error_message;
  fail.textContent = bench.error_message ? bench.error_message
    : `${failures.length} low-precision result(s) failed the check against BF16: ${failures.join("; ")}`;
}

function renderSelector() {
  const select = document.getElementById("gemm-benchmark");
  setHTML(select, joinHtml(gemmState.list.map((b) => html`<option value="${b.id}">#${b.id} ${b.name || ""} · ${
    b.device_name || ""} · ${b.status}</option>`)));
  select.value = String(gemmState.selectedId);
  select.closest("label").hidden = gemmState.list.length < 2;
}

function render() {
  const bench = gemmState.detail;
  renderSelector();
  const hasResult = bench && bench.status === "succeeded" && bench.result && bench.result.results;
  document.getElementById("gemm-result").hidden = !hasResult;
  if (!bench) return;
  if (!hasResult) {
    setHTML(document.getElementById("gemm-meta"), html`${statusBadge(bench.status)} GEMM benchmark #${bench.id}`);
    const fail = document.getElementById("gemm-failures");
    fail.hidden = !bench.error_message;
    fail.textContent = bench.error_message || "";
    return;
  }
  renderMeta(bench);
  renderShapes(bench.result);
  renderPrediction(bench.result);
  if (window.Plotly) {
    drawBars(bench.result);
    gemmState.drawn = true;
  }
}

// ---------------------------------------------------------------- data

async function refresh() {
  // The list first: an experiment without benchmarks costs the page one small request and no polling.
  const page = await get(`/api/v1/gemm-benchmarks?experiment_id=${encodeURIComponent(experimentId)}&limit=50`);
  gemmState.list = items(page);
  panel.hidden = gemmState.list.length === 0;
  if (!gemmState.list.length) {
    gemmState.refreshes += 1;
    return;
  }
  const experiment = await get(`/api/v1/experiments/${encodeURIComponent(experimentId)}`);
  gemmState.experiment = experiment;
  gemmState.runs = items(experiment.runs || [], "runs");
  if (!gemmState.list.some((b) => b.id === gemmState.selectedId)) {
    gemmState.selectedId = (gemmState.list.find((b) => b.status === "succeeded") || gemmState.list[0]).id;
  }
  // A finished benchmark never changes: its (large) result is fetched once; only the runs are re-read.
  const listed = gemmState.list.find((b) => b.id === gemmState.selectedId);
  if (!gemmState.detail || gemmState.detail.id !== listed.id || gemmState.detail.status !== listed.status) {
    gemmState.detail = await get(`/api/v1/gemm-benchmarks/${gemmState.selectedId}`);
  }
  render();
  if (!gemmState.drawn && gemmState.detail.status === "succeeded") {
    await plotlyReady();
    render();
  }
  gemmState.refreshes += 1;
}

async function tick() {
  try {
    await refresh();
  } catch (err) {
    document.getElementById("gemm-failures").hidden = false;
    document.getElementById("gemm-failures").textContent = `GEMM benchmarks could not be loaded: ${err.message}`;
  }
}

// Polled while a benchmark is still to finish, or while training runs may still change the measured column.
function live() {
  return gemmState.list.some((b) => LIVE_STATUSES.has(b.status))
    || (gemmState.list.length > 0 && gemmState.runs.some((r) => LIVE_STATUSES.has(r.status)));
}

// The panel in the page's one poller (poller.js); the benchmark selector redraws at once.
export function mount() {
  document.getElementById("gemm-benchmark").addEventListener("change", (e) => {
    gemmState.selectedId = Number(e.target.value);
    gemmState.drawn = false;
    tick();
  });
  register({ name: "gemm", refresh: tick, live, everyMs: EVERY_MS });
}
