// Verdict panel of the experiment page: the one-line verdict of GET /api/v1/experiments/{id}/verdict (on final
// validation loss, by the rule it names), and the decision table: one row per run with validation loss, Δ vs BF16,
// speedup, MFU, peak memory, accuracy Δ per task (Holm-corrected significance, next to BF16's seed spread) and
// status. Columns sort on click; sort and filters live in the page URL (?sort=speedup&dir=desc&status=succeeded),
// so a shared link opens the same view. Also exports `seedBandTraces`, BF16's seed band for the relative-loss chart.
import { get, items, LIVE_STATUSES } from "../api.js";
import { html, joinHtml, plotText, setHTML, statusBadge } from "../dom.js";
import { register } from "../poller.js";
import { gemmBackend, mfu, mfuPercent, MFU_CONVENTION, peakMemory, runLabel } from "../summary.js";

const root = document.getElementById("experiment-root");
const experimentId = root?.dataset.experimentId;
const panel = document.getElementById("verdict-panel");
const TASK_METRICS = ["acc", "bits_per_byte", "perplexity", "acc_norm"];
const OUTCOME_TEXT = { matches: "matches BF16", better: "better than BF16", worse: "worse than BF16",
  diverged: "diverged" };

// `loads` counts completed loads (tests wait on it).
export const verdictState = { verdict: null, runs: [], loads: 0, failed: false, gone: false };
window.plabVerdict = verdictState;

// ---------------------------------------------------------------- numbers
function finite(x) {
  return typeof x === "number" && Number.isFinite(x);
}

function signed(x, digits = 2, unit = "%") {
  if (!finite(x)) return "–";
  return `${x > 0 ? "+" : x < 0 ? "−" : "±"}${Math.abs(x).toFixed(digits)}${unit}`;
}

function isAccuracy(metric) {
  return /^acc/.test(metric || "");
}

// Accuracy differences in percentage points, other metrics (bits per byte, perplexity) as they are.
function formatAccDelta(metric, x) {
  return isAccuracy(metric) ? signed(finite(x) ? 100 * x : x, 1, " pp") : signed(x, 3, "");
}

// ---------------------------------------------------------------- the URL's view state
const SORTS = new Set(["label", "status", "val_loss", "val_delta", "speedup", "mfu", "peak_mem"]);

export function viewState() {
  const q = new URLSearchParams(window.location.search);
  const sort = q.get("sort") || "";
  return {
    sort: SORTS.has(sort) || sort.startsWith("acc:") ? sort : "",
    dir: q.get("dir") === "desc" ? "desc" : "asc",
    status: q.get("status") || "",
    recipe: q.get("recipe") || "",
  };
}

function setView(changes) {
  const q = new URLSearchParams(window.location.search);
  for (const [k, v] of Object.entries(changes)) {
    if (v) q.set(k, v); else q.delete(k);
  }
  const search = q.toString();
  window.history.replaceState(null, "", `${window.location.pathname}${search ? `?${search}` : ""}`);
  render();
}

// ---------------------------------------------------------------- rows
function taskColumns(verdict) {
  const byTask = new Map();
  for (const run of verdict.runs || []) {
    for (const row of run.accuracy || []) {
      const have = byTask.get(row.task);
      const rank = TASK_METRICS.indexOf(row.metric);
      if (!have || (rank >= 0 && (TASK_METRICS.indexOf(have) < 0 || rank < TASK_METRICS.indexOf(have)))) {
        byTask.set(row.task, row.metric);
      }
    }
  }
  return [...byTask.entries()].map(([task, metric]) => ({ task, metric }));
}

function rowsOf(verdict) {
  const facts = new Map((verdict.runs || []).map((r) => [r.run_id, r]));
  return verdictState.runs.map((run) => {
    const f = facts.get(run.id) || {};
    const m = mfu(run);
    return {
      run, facts: f, label: runLabel(run), status: run.status, val_loss: f.final_val_loss ?? null,
      val_delta: f.val_delta_pct ?? null,
      speedup: f.speedup ?? null, mfu: mfuPercent(m), peak_mem: peakMemory(run),
      accuracy: new Map((f.accuracy || []).map((a) => [`${a.task}|${a.metric}`, a])),
    };
  });
}

function sortValue(row, key) {
  if (key.startsWith("acc:")) return row.accuracy.get(key.slice(4))?.delta ?? null;
  return row[key];
}

export function sortRows(rows, sort, dir) {
  if (!sort) return rows;
  const sign = dir === "desc" ? -1 : 1;
  // Missing values sort last whichever the direction: a run without a figure is not the best or the worst.
  return rows.slice().sort((a, b) => {
    const x = sortValue(a, sort), y = sortValue(b, sort);
    if (x == null || y == null) return (x == null) - (y == null);
    return sign * (typeof x === "string" ? x.localeCompare(y, undefined, { numeric: true }) : x - y);
  });
}

// ---------------------------------------------------------------- drawing
function ensureLayout() {
  if (!panel || panel.dataset.built) return;
  setHTML(panel, html`
    <style>
      #decision-table th.sortable { cursor: pointer; white-space: nowrap; }
      #decision-table th[aria-sort="ascending"]::after { content: " ▲"; }
      #decision-table th[aria-sort="descending"]::after { content: " ▼"; }
      #decision-table .outcome-matches, #decision-table .outcome-better { color: #067647; font-weight: 600; }
      #decision-table .outcome-worse, #decision-table .outcome-diverged { color: var(--error); font-weight: 600; }
      #decision-table .outcome-unresolved { color: var(--muted, #667085); font-weight: 600; }
      #decision-table .spread { display: block; font-size: 11px; }
      #decision-table-wrap { overflow-x: auto; }
    </style>
    <div class="panel-head">
      <h2>Verdict</h2>
      <form class="controls" data-no-submit>
        <label>status <select id="decision-status"><option value="">all</option></select></label>
        <label>recipe <select id="decision-recipe"><option value="">all</option></select></label>
      </form>
    </div>
    <p id="verdict-rule" class="hint"></p>
    <p id="verdict-accuracy-error" class="form-error" role="alert" hidden></p>
    <div id="decision-table-wrap"><table id="decision-table" class="data-table"><thead></thead><tbody></tbody></table></div>
    <p class="hint">Δ vs BF16 is the final validation loss against the reference BF16 run (its first seed);
      speedup is tokens/s over the mean of the BF16 seeds' on the same device (below 1: a slowdown; on
      <em>emulated</em> GEMMs not the format's hardware speed; n/a for a run on a device no BF16 run used). Accuracy Δ is paired over the documents both runs scored; ▲/▼ mark differences significant after Holm's
      correction across tasks (the uncorrected p is in the tooltip). Its interval covers the sampling of documents
      for these checkpoints only; seed-to-seed variation shows only where BF16 has seed replicates (their spread in
      brackets). Click a column to sort.</p>`);
  panel.dataset.built = "true";
  for (const [id, key] of [["decision-status", "status"], ["decision-recipe", "recipe"]]) {
    document.getElementById(id).addEventListener("change", (e) => setView({ [key]: e.target.value }));
  }
  panel.querySelector("thead").addEventListener("click", (e) => {
    const th = e.target.closest("th[data-sort]");
    if (!th) return;
    const view = viewState();
    const dir = view.sort === th.dataset.sort && view.dir === "asc" ? "desc" : "asc";
    setView({ sort: th.dataset.sort, dir });
  });
}

function syncFilter(id, values, current) {
  const select = document.getElementById(id);
  const wanted = [...new Set(values)].sort();
  if (select.dataset.values !== wanted.join("|")) {
    setHTML(select, html`<option value="">all</option>${wanted.map((v) => html`<option value="${v}">${v}</option>`)}`);
    select.dataset.values = wanted.join("|");
  }
  select.value = wanted.includes(current) ? current : "";
}

function header(key, label, view, title = "") {
  const sorted = view.sort === key ? (view.dir === "desc" ? "descending" : "ascending") : "none";
  return html`<th class="sortable" data-sort="${key}" aria-sort="${sorted}" ${""
    }title="${title}">${label}</th>`;
}

function accuracyCell(row, col) {
  const a = row.accuracy.get(`${col.task}|${col.metric}`);
  if (!a) return html`<td class="num muted">–</td>`;
  const mark = a.significant ? (a.delta > 0 ? "▲" : "▼") : "n.s.";
  const spread = a.baseline_seed_spread;
  const title = `${a.method}, n = ${a.n}; p = ${finite(a.p_value) ? a.p_value.toPrecision(2) : "?"} uncorrected, `
    + `${finite(a.p_holm) ? a.p_holm.toPrecision(2) : "?"} after Holm`;
  return html`<td class="num" data-task="${col.task}" data-significant="${String(Boolean(a.significant))}" title="${title}">${""
    }${formatAccDelta(a.metric, a.delta)} <span class="acc-marker">${mark}</span>${spread && html`<span ${""
    }class="spread muted" title="BF16 seed-to-seed spread">BF16 seeds [${formatAccDelta(a.metric, spread[0])}, ${""
    }${formatAccDelta(a.metric, spread[1])}]</span>`}</td>`;
}

function outcomeOf(verdict, row) {
  const entry = (verdict.recipes || []).find((e) => e.run_ids.includes(row.run.id));
  if (row.run.id === verdict.reference_run_id) return html`<span class="muted">reference</span>`;
  if (!entry) return row.facts.is_baseline ? html`<span class="muted">BF16 seed replicate</span>` : "";
  if (entry.outcome === "matches" && entry.resolved === false) {
    // inside a seed band wider than the experiment's tolerance: not a claim of equivalence
    const band = entry.band_pct ? ` [${signed(entry.band_pct[0])}, ${signed(entry.band_pct[1])}]` : "";
    return html`<span class="outcome-unresolved" title="${`inside BF16's seed band${band}, wider than the ${""
      }experiment's ±${verdict.tolerance_pct}% tolerance: more BF16 seeds or longer runs narrow it`}">${""
      }inside BF16's noise</span>`;
  }
  return entry.outcome ? html`<span class="outcome-${entry.outcome}">${OUTCOME_TEXT[entry.outcome]}</span>` : "";
}

function bodyRow(verdict, row, tasks) {
  const backend = gemmBackend(row.run);
  const speed = finite(row.speedup)
    // A BF16 seed's ratio is its throughput against the seeds' mean (their spread), not a slowdown.
    ? html`${row.speedup.toFixed(2)}×${row.speedup < 1 && !row.facts.is_baseline
      ? html` <span class="muted">slowdown</span>` : ""}`
    : row.facts.speedup_note && finite(row.facts.tokens_per_s)
      ? html`<span class="muted" title="${row.facts.speedup_note}">n/a</span>` : "–";
  return html`<tr data-verdict-run-id="${row.run.id}" data-status="${row.status}">
    <td>${row.label}${backend === "emulated" && html` <span class="gemm gemm-emulated">emulated</span>`}</td>
    <td>${statusBadge(row.status)}</td>
    <td class="num" data-col="val_loss">${finite(row.val_loss) ? row.val_loss.toFixed(4) : "–"}</td>
    <td class="num" data-col="val_delta">${row.run.id === verdict.reference_run_id ? "reference" : signed(row.val_delta)}</td>
    <td class="num" data-col="speedup">${speed}</td>
    <td class="num" data-col="mfu">${finite(row.mfu) ? `${row.mfu.toFixed(1)}%` : html`<span class="muted" ${""
      }title="no dense BF16 peak is known for this device (a CPU, or a GPU not in the peak table)">–</span>`}</td>
    <td class="num">${finite(row.peak_mem) ? row.peak_mem.toFixed(2) : html`<span class="muted" ${""
      }title="not measured: GPU memory only">–</span>`}</td>
    ${tasks.map((c) => accuracyCell(row, c))}
    <td>${outcomeOf(verdict, row)}</td>
  </tr>`;
}

export function render() {
  const verdict = verdictState.verdict;
  if (!panel || !verdict) return;
  ensureLayout();
  const view = viewState();
  const summary = document.getElementById("experiment-summary");
  if (summary) summary.textContent = verdict.summary || "";
  document.getElementById("verdict-rule").textContent = verdict.rule_text
    ? `Rule: ${verdict.rule_text}.` : "";
  const accError = document.getElementById("verdict-accuracy-error");
  accError.hidden = !verdict.accuracy_error;
  accError.textContent = verdict.accuracy_error ? `Accuracy not compared: ${verdict.accuracy_error}` : "";
  const all = rowsOf(verdict);
  syncFilter("decision-status", all.map((r) => r.status), view.status);
  syncFilter("decision-recipe", all.map((r) => r.run.recipe), view.recipe);
  const shown = sortRows(all.filter((r) => (!view.status || r.status === view.status)
    && (!view.recipe || r.run.recipe === view.recipe)), view.sort, view.dir);
  const tasks = taskColumns(verdict);
  setHTML(panel.querySelector("thead"), html`<tr>${header("label", "Run", view)}${header("status", "Status", view)}${
    header("val_loss", "Val loss", view, "final validation loss: mean cross-entropy over the held-out windows, nats per token")}${
    header("val_delta", "Δ vs BF16", view, "final validation loss vs the BF16 reference run (its first seed), percent")}${
    header("speedup", "Speedup", view, "tokens/s over BF16's on the same device")}${header("mfu", "MFU", view, MFU_CONVENTION)}${
    header("peak_mem", "Peak mem (GiB)", view)}${
    tasks.map((c) => header(`acc:${c.task}|${c.metric}`, `${c.task} Δ`, view, `${c.metric}, recipe − BF16`))}${""
    }<th>Verdict</th></tr>`);
  setHTML(panel.querySelector("tbody"), shown.length ? joinHtml(shown.map((r) => bodyRow(verdict, r, tasks)))
    : html`<tr class="placeholder"><td colspan="${8 + tasks.length}">${all.length
      ? "No run matches the filters." : "This experiment has no runs."}</td></tr>`);
}

// ---------------------------------------------------------------- BF16's seed band on the relative-loss chart
// Student's t quantile t(0.975, df) for df = 1..30 (scipy.stats.t.ppf; a browser test checks them against it).
const T975 = [12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
  2.200985, 2.178813, 2.160369, 2.144787, 2.13145, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963, 2.079614,
  2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.04523, 2.042272];
// Beyond 30 degrees of freedom the table's last entry (slightly wider than the true quantile).
export function t975(df) {
  return df >= 1 ? T975[Math.min(df, T975.length) - 1] : NaN;
}

// The verdict's rule (training.evaluation.verdict) drawn at each of the reference run's points: BF16's n seeds'
// relative differences to the reference (its own 0 among them), mean ± t(0.975, n-1) · sd · sqrt(1 + 1/n), the 95%
// band one more seed of a recipe that trains like BF16 would fall in. Two traces (low, then high filled to it);
// empty without replicates. `smooth(y)` is the chart's smoothing: each replicate's difference is smoothed
// before the spread is taken, as the recipes' differences are drawn smoothed (a band from the raw differences,
// edges smoothed after, held the raw step-to-step noise: about twice as wide at the default 0.6).
export function seedBandTraces(diffs, smooth = (y) => y) {
  // diffs: each BF16 replicate's relative difference to the reference run ({x, y} in percent, on the
  // reference's points); the reference itself is 0 everywhere.
  if (!diffs.length) return [];
  const values = new Map();
  for (const diff of diffs) {
    const keep = diff.x.map((_, i) => Number.isFinite(diff.y[i]));
    const xs = diff.x.filter((_, i) => keep[i]);
    const ys = smooth(diff.y.filter((_, i) => keep[i]));
    xs.forEach((x, i) => {
      if (!values.has(x)) values.set(x, [0]);
      values.get(x).push(ys[i]);
    });
  }
  const xs = [...values.keys()].sort((a, b) => a - b);
  if (!xs.length) return [];
  const lo = [], hi = [];
  for (const x of xs) {
    const v = values.get(x), n = v.length;
    const mean = v.reduce((a, b) => a + b, 0) / n;
    const sd = Math.sqrt(v.reduce((a, b) => a + (b - mean) ** 2, 0) / (n - 1));
    const half = t975(n - 1) * sd * Math.sqrt(1 + 1 / n);
    lo.push(mean - half);
    hi.push(mean + half);
  }
  const name = plotText(`BF16 seed band (95% for one seed, from ${diffs.length + 1} seeds)`);
  const common = { type: "scatter", mode: "lines", x: xs, line: { width: 0 }, hoverinfo: "skip",
    meta: { seed_band: true } };
  return [
    { ...common, name, y: lo, showlegend: false },
    { ...common, name, y: hi, fill: "tonexty", fillcolor: "rgba(120,120,120,0.25)" },
  ];
}

// ---------------------------------------------------------------- data
async function refresh() {
  try {
    const [experiment, verdict] = await Promise.all([
      get(`/api/v1/experiments/${encodeURIComponent(experimentId)}`),
      get(`/api/v1/experiments/${encodeURIComponent(experimentId)}/verdict`),
    ]);
    verdictState.runs = items(experiment.runs || [], "runs");
    verdictState.verdict = verdict;
    verdictState.failed = false;
    render();
  } catch (err) {
    verdictState.failed = err.status !== 404;
    verdictState.gone = err.status === 404;
    if (panel && verdictState.failed) {
      ensureLayout();
      const el = document.getElementById("verdict-rule");
      el.textContent = `The verdict could not be loaded: ${err.message}`;
    }
  }
  verdictState.loads += 1;
}

function live() {
  return !verdictState.gone && (verdictState.failed || verdictState.runs.some((r) => LIVE_STATUSES.has(r.status)));
}

export function mount() {
  // The verdict reads every run's validation loss and the accuracy table: every 4 s is live enough.
  if (panel) register({ name: "verdict", refresh, live, everyMs: 4000 });
}
