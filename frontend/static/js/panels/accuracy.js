// Accuracy panel of the experiment page: downstream accuracy per task × recipe from
// /api/v1/experiments/{id}/accuracy, each recipe's paired difference to the BF16 run with its 95% interval and a
// significance marker, and a bar chart of those differences. Evaluations run as Celery jobs long after training;
// the panel polls while any evaluation (or run, whose success may start one) is still to finish.
import { get, items, LIVE_STATUSES } from "../api.js";
import { BOTTOM_LEGEND, colorAt, emulatedPattern, PLOT_CONFIG, plotlyReady } from "../plot.js";
import { POLL_MS, register } from "../poller.js";
import { html, joinHtml, plotText, setHTML, statusBadge } from "../dom.js";
import { gemmBackend, recipeName, runLabel } from "../summary.js";

const root = document.getElementById("experiment-root");
const experimentId = root.dataset.experimentId;
const panel = document.getElementById("accuracy-panel");
// The number a task is judged by: accuracy where the task has one, else bits per byte (held-out text),
// else perplexity; lm-eval's other metrics (acc_norm, word_perplexity, …) stay in the hover text.
const MAIN_METRICS = ["acc", "bits_per_byte", "perplexity", "acc_norm", "byte_perplexity", "word_perplexity"];
const LOWER_IS_BETTER = new Set(["bits_per_byte", "perplexity", "byte_perplexity", "word_perplexity"]);
const METHOD_NOTES = {
  bootstrap: (n) => "Δ = recipe − BF16 on the documents both runs scored (the same documents, checked by lm-eval's "
    + "task hash). The 95% interval is a paired percentile bootstrap over documents (the same documents resampled "
    + `for both runs, ${n.toLocaleString("en-US")} resamples; within each subtask for groups).`,
  mcnemar: () => "Δ = recipe − BF16 on the documents both runs scored (the same documents, checked by lm-eval's "
    + "task hash). For 0/1 metrics: exact McNemar test on the documents exactly one of the two runs got right, with "
    + "the Wald interval of the paired difference; other metrics (perplexity, bits per byte) use the paired "
    + "bootstrap over documents.",
};
// What every table's significance and interval mean, whatever the method.
const SIGNIFICANCE_NOTE = "▲/▼ mark differences significant after Holm's correction over the recipe's tasks "
  + "(family-wise α = 0.05; the uncorrected p is in the tooltip). The interval covers the sampling of documents "
  + "for these two checkpoints; variation between training seeds is measured only by seed replicates (the verdict "
  + "table shows BF16's seed spread beside each difference where the experiment has them).";
const CONVENTION_NOTE = "Every recipe keeps the LM head and the embeddings (and norms) in BF16, by convention: "
  + "differences come from the transformer blocks' low-precision GEMMs.";

// `refreshes` counts completed loads and `accuracyLoads` the accuracy-table requests (tests wait on them).
export const accuracyState = {
  method: "bootstrap", runs: [], evaluations: new Map(), table: null, signature: null, failed: false,
  refreshes: 0, accuracyLoads: 0, drawn: false,
};
window.plabAccuracy = accuracyState;

// ---------------------------------------------------------------- reading the table
export function mainMetric(metrics) {
  const names = Object.keys(metrics || {}).filter((m) => metrics[m] && typeof metrics[m].value === "number");
  return MAIN_METRICS.find((m) => names.includes(m)) || names.sort()[0] || null;
}

// Accuracies read as percentages (and their differences as percentage points); other metrics as they are.
function isAccuracy(metric) {
  return /^acc/.test(metric || "");
}

function finite(x) {
  return typeof x === "number" && Number.isFinite(x);
}

export function formatValue(metric, x) {
  if (!finite(x)) return "–";
  return isAccuracy(metric) ? `${(100 * x).toFixed(1)}%` : x.toPrecision(4);
}

function formatStderr(metric, x) {
  if (!finite(x)) return "";
  return isAccuracy(metric) ? (100 * x).toFixed(1) : x.toPrecision(2);
}

export function formatDelta(metric, x) {
  if (!finite(x)) return "–";
  const sign = x > 0 ? "+" : x < 0 ? "−" : "±";
  return isAccuracy(metric) ? `${sign}${Math.abs(100 * x).toFixed(1)} pp` : `${sign}${Math.abs(x).toPrecision(3)}`;
}

function formatBound(metric, x) {
  if (!finite(x)) return "?";
  const sign = x < 0 ? "−" : "";
  return isAccuracy(metric) ? `${sign}${Math.abs(100 * x).toFixed(1)}` : `${sign}${Math.abs(x).toPrecision(3)}`;
}

// ▲/▼ say which way the number moved; the colour says whether that is better (`improved` from the API, which
// knows each metric's direction). An interval covering 0 is "n.s." whatever the sign of Δ.
export function significance(row) {
  if (!row || !row.significant) return { mark: "n.s.", cls: "acc-ns", title: "not significant (Holm-corrected)" };
  const mark = row.delta > 0 ? "▲" : "▼";
  if (row.improved === true) return { mark, cls: "acc-better", title: "significantly better than BF16" };
  if (row.improved === false) return { mark, cls: "acc-worse", title: "significantly worse than BF16" };
  return { mark, cls: "acc-neutral", title: "significant (direction of better unknown)" };
}

// The same name and colour as the page's other charts give the run (experiment.js: label, palette by run order).
function runName(run) {
  const full = accuracyState.runs.find((r) => r.id === run.run_id);
  return full ? runLabel(full) : (run.label || run.recipe || recipeName(run));
}

function runColor(table, run) {
  const index = (table.runs || []).findIndex((r) => r.run_id === run.run_id);
  return colorAt(Math.max(index, 0));
}

function isEmulated(run) {
  return gemmBackend(run) === "emulated";
}

// Task order: the order the API lists them for the first run that has each, so a user's task list order holds.
function taskNames(table) {
  const names = [];
  for (const run of table.runs || []) for (const t of Object.keys(run.tasks || {})) if (!names.includes(t)) names.push(t);
  return names;
}

function comparisonRow(run, task, metric) {
  return (run.vs_bf16 || []).find((r) => r.task === task && r.metric === metric) || null;
}

function taskMetric(table, task) {
  for (const run of table.runs || []) {
    const m = mainMetric(run.tasks?.[task]);
    if (m) return m;
  }
  return null;
}

function lowerIsBetter(table, task, metric) {
  for (const run of table.runs || []) {
    const row = comparisonRow(run, task, metric);
    if (row && row.higher_is_better != null) return !row.higher_is_better;
  }
  return LOWER_IS_BETTER.has(metric);
}

// Runs that have any result, BF16 first: the column everyone is compared against.
function evaluatedRuns(table) {
  const runs = (table.runs || []).filter((r) => Object.keys(r.tasks || {}).length);
  return [...runs].sort((a, b) => (b.run_id === table.baseline_run_id) - (a.run_id === table.baseline_run_id));
}

// ---------------------------------------------------------------- drawing
function ensureLayout() {
  if (panel.dataset.built) return;
  panel.classList.add("panel");
  setHTML(panel, html`
    <style>
      #accuracy-table td.acc-cell { white-space: nowrap; }
      #accuracy-table .acc-delta { display: block; font-size: 12px; }
      #accuracy-table .acc-better { color: #067647; font-weight: 600; }
      #accuracy-table .acc-worse { color: var(--error); font-weight: 600; }
      #accuracy-table .acc-ns, #accuracy-table .acc-neutral { color: var(--muted); }
      #accuracy-table th.emulated, #accuracy-table td.emulated { background: repeating-linear-gradient(45deg,
        #fff7e6, #fff7e6 4px, #fde9c4 4px, #fde9c4 8px); }
      #accuracy-table-wrap { overflow-x: auto; }
    </style>
    <div class="panel-head">
      <h2>Downstream accuracy</h2>
      <form class="controls" data-no-submit>
        <label>interval
          <select id="accuracy-method">
            <option value="bootstrap">paired bootstrap</option>
            <option value="mcnemar">McNemar (0/1 metrics)</option>
          </select>
        </label>
      </form>
    </div>
    <p id="accuracy-status" class="muted"></p>
    <p id="accuracy-error" class="form-error" role="alert" hidden></p>
    <p id="accuracy-empty" class="hint" hidden>No evaluation of this experiment's runs yet. Start one once a run has
      succeeded with <code>plab eval RUN_ID --tasks plab_piqa,plab_arc_easy</code> (or
      <code>POST /api/v1/runs/RUN_ID/evaluations</code>), or create the experiment with <code>eval_tasks</code> so
      every run is evaluated when its training succeeds. Evaluate the BF16 run too: it is the reference.</p>
    <div id="accuracy-result" hidden>
      <div id="accuracy-table-wrap"><table id="accuracy-table" class="data-table"><thead></thead><tbody></tbody></table></div>
      <div id="accuracy-delta-chart" class="chart chart-small"></div>
    </div>
    <p class="hint"><span id="accuracy-method-note"></span> <span id="accuracy-convention">${CONVENTION_NOTE}</span>
      Hatched columns and bars ran on <em>emulated</em> GEMMs (quantize → dequantize → BF16 GEMM): their accuracy is
      the format's.</p>`);
  panel.dataset.built = "true";
  const select = document.getElementById("accuracy-method");
  select.value = accuracyState.method;
  select.addEventListener("change", (e) => {
    accuracyState.method = e.target.value;
    accuracyState.signature = null; // a new method needs a new table whatever the evaluations did
    tick();
  });
}

function runHeader(run, baselineId) {
  const emulated = isEmulated(run);
  const tag = run.run_id === baselineId ? html` <span class="muted">(reference)</span>`
    : emulated && html` <span class="gemm gemm-emulated">emulated GEMMs</span>`;
  return html`<th class="${emulated ? "emulated" : ""}" data-run-id="${run.run_id}" data-recipe="${run.recipe}" ${""
    }data-emulated="${emulated}">${runName(run)}${tag}</th>`;
}

function cell(table, run, task, metric) {
  const m = run.tasks?.[task]?.[metric];
  const emulated = isEmulated(run) ? " emulated" : "";
  if (!m) return html`<td class="acc-cell num${emulated}" data-run-id="${run.run_id}">–</td>`;
  const others = Object.entries(run.tasks[task]).filter(([k]) => k !== metric)
    .map(([k, v]) => `${k}: ${formatValue(k, v?.value)}`).join(", ");
  const stderr = formatStderr(metric, m.stderr);
  const parts = [html`<span class="acc-value">${formatValue(metric, m.value)}</span>${
    stderr && html` <span class="muted">± ${stderr}</span>`}`];
  if (run.run_id !== table.baseline_run_id && table.baseline_run_id != null) {
    const row = comparisonRow(run, task, metric);
    if (row) {
      const sig = significance(row);
      const title = `${sig.title}; ${row.method}, n = ${row.n} paired documents${
        finite(row.p_value) ? `, p = ${row.p_value.toPrecision(2)} uncorrected` : ""}${
        finite(row.p_holm) ? `, ${row.p_holm.toPrecision(2)} after Holm over ${row.family_size} comparisons` : ""}`;
      parts.push(html`<span class="acc-delta" data-significant="${row.significant}" title="${title}">${""
        }Δ ${formatDelta(metric, row.delta)} [${formatBound(metric, row.ci_low)}, ${formatBound(metric, row.ci_high)}] ${""
        }<span class="acc-marker ${sig.cls}">${sig.mark}</span></span>`);
    } else {
      parts.push(html`<span class="acc-delta muted" title="the baseline has no per-document results for this task ${""
        }to pair with">Δ –</span>`);
    }
  }
  return html`<td class="acc-cell num${emulated}" data-run-id="${run.run_id}" title="${others}">${parts}</td>`;
}

function renderTable(table) {
  const runs = evaluatedRuns(table);
  const tasks = taskNames(table);
  setHTML(document.querySelector("#accuracy-table thead"), html`<tr><th>Task</th><th>Metric</th>${
    runs.map((r) => runHeader(r, table.baseline_run_id))}</tr>`);
  setHTML(document.querySelector("#accuracy-table tbody"), joinHtml(tasks.map((task) => {
    const metric = taskMetric(table, task);
    const direction = lowerIsBetter(table, task, metric) ? "lower is better" : "higher is better";
    return html`<tr data-task="${task}" data-metric="${metric || ""}"><td>${task}</td>${""
      }<td title="${direction}">${metric || "–"}${!isAccuracy(metric) && html` <span class="muted">(${
        direction === "lower is better" ? "↓" : "↑"} better)</span>`}</td>${
      runs.map((r) => cell(table, r, task, metric))}</tr>`;
  })));
}

// One trace per compared run. The y axis is Δ relative to BF16's value in % (as the page's relative-loss chart),
// because one axis has to carry accuracies and bits per byte alike; the hover gives the absolute Δ.
export function deltaTraces(table) {
  const tasks = taskNames(table);
  const compared = evaluatedRuns(table).filter((r) => r.run_id !== table.baseline_run_id && (r.vs_bf16 || []).length);
  return compared.map((run) => {
    const rows = tasks.map((t) => comparisonRow(run, t, taskMetric(table, t)));
    // Accuracy differences in percentage points, as in the table; other metrics (bits per byte) in their unit.
    const rel = (x, row) => (row && finite(x) ? (isAccuracy(row.metric) ? 100 * x : x) : null);
    const emulated = isEmulated(run);
    return {
      type: "bar", name: plotText(`${runName(run)}${emulated ? " (emulated GEMMs)" : ""}`), x: tasks.map(plotText),
      y: rows.map((row) => rel(row?.delta, row)),
      error_y: { type: "data", symmetric: false, visible: true, color: "#333", thickness: 1.2,
        array: rows.map((row) => rel(row && row.ci_high - row.delta, row)),
        arrayminus: rows.map((row) => rel(row && row.delta - row.ci_low, row)) },
      text: rows.map((row) => (row ? significance(row).mark : "")), textposition: "outside",
      // Hover text is Plotly's pseudo-HTML: the metric's name (a user's task may name it anything) is escaped.
      customdata: rows.map((row, j) => (row ? [plotText(row.metric), formatDelta(row.metric, row.delta),
        `[${formatBound(row.metric, row.ci_low)}, ${formatBound(row.metric, row.ci_high)}]`, significance(row).title,
        formatValue(row.metric, row.baseline), formatValue(row.metric, row.candidate)] : [plotText(taskMetric(table, tasks[j])), "–", "", "not compared", "", ""])),
      hovertemplate: `${plotText(runName(run))}<br>%{x} %{customdata[0]}: %{customdata[5]} vs BF16 %{customdata[4]}`
        + "<br>Δ %{customdata[1]} %{customdata[2]}<br>%{customdata[3]}<extra></extra>",
      marker: { color: runColor(table, run),
        pattern: emulatedPattern(emulated) },
      meta: { run_id: run.run_id, recipe: run.recipe, emulated },
    };
  });
}

function drawChart(table) {
  const el = document.getElementById("accuracy-delta-chart");
  const traces = deltaTraces(table);
  el.hidden = traces.length === 0;
  if (!traces.length || !window.Plotly) return;
  window.Plotly.react(el, traces, {
    title: { text: `Difference to BF16 with ${Math.round(100 * (table.confidence || 0.95))}% interval`, font: { size: 14 } },
    barmode: "group", margin: { l: 70, r: 20, t: 40, b: 90 },
    yaxis: { title: { text: "Δ vs BF16 (accuracy: points)" }, zeroline: true, zerolinecolor: "#111" },
    xaxis: { tickangle: -25, automargin: true },
    legend: BOTTOM_LEGEND,
  }, PLOT_CONFIG);
  accuracyState.drawn = true;
}

function renderStatus() {
  const all = [...accuracyState.evaluations.values()].flat();
  const live = all.filter((e) => LIVE_STATUSES.has(e.status));
  const failed = all.filter((e) => e.status === "failed");
  const byRun = new Map(accuracyState.runs.map((r) => [r.id, r]));
  const describe = (e) => html`${statusBadge(e.status)} ${runLabel(byRun.get(e.run_id) || { recipe: `run ${e.run_id}` })}${""
    } <span class="muted">(${(e.tasks || []).join(", ")}${e.results?.length ? `, ${e.results.length}/${
      (e.tasks || []).length} done` : ""})</span>`;
  const parts = live.map(describe);
  if (live.length) parts.push(html`<span class="muted">updating every ${POLL_MS / 1000} s</span>`);
  const status = document.getElementById("accuracy-status");
  setHTML(status, joinHtml(parts, " · "));
  status.dataset.live = String(live.length > 0);
  const error = document.getElementById("accuracy-error");
  error.hidden = failed.length === 0;
  error.textContent = failed.map((e) => `Evaluation #${e.id} of ${runLabel(byRun.get(e.run_id) || { recipe: `run ${e.run_id}` })}`
    + ` failed: ${(e.error_message || "no message").split("\n")[0]}`).join("\n");
}

function render() {
  ensureLayout();
  renderStatus();
  const table = accuracyState.table;
  const hasResults = !!table && evaluatedRuns(table).length > 0;
  const anyEvaluation = [...accuracyState.evaluations.values()].some((list) => list.length);
  document.getElementById("accuracy-empty").hidden = anyEvaluation;
  document.getElementById("accuracy-result").hidden = !hasResults;
  document.getElementById("accuracy-method-note").textContent = METHOD_NOTES[accuracyState.method](
    table?.n_boot ?? 10000) + ` ${SIGNIFICANCE_NOTE}` + (
    hasResults && table.baseline_run_id == null ? " No BF16 run has finished an evaluation yet: evaluate it to see differences." : "");
  if (!hasResults) return;
  renderTable(table);
  drawChart(table);
}

// ---------------------------------------------------------------- data

// The accuracy table costs the server a bootstrap per task and recipe: ask for it again only when an evaluation
// changed (new, finished, or a task result more), not on every poll.
function evaluationSignature() {
  return [...accuracyState.evaluations.entries()].map(([runId, list]) => `${runId}:`
    + list.map((e) => `${e.id}/${e.status}/${(e.results || []).length}`).join(",")).join(";") + `|${accuracyState.method}`;
}

async function refresh() {
  const experiment = await get(`/api/v1/experiments/${encodeURIComponent(experimentId)}`);
  accuracyState.runs = items(experiment.runs || [], "runs");
  // Only a run that succeeded can have been evaluated (the API refuses the others).
  const candidates = accuracyState.runs.filter((r) => r.status === "succeeded");
  const lists = await Promise.all(candidates.map((r) => get(`/api/v1/runs/${r.id}/evaluations`)));
  accuracyState.evaluations = new Map(candidates.map((r, i) => [r.id, items(lists[i])]));
  const signature = evaluationSignature();
  const hasEvaluations = [...accuracyState.evaluations.values()].some((l) => l.length);
  if (hasEvaluations && signature !== accuracyState.signature) {
    const method = accuracyState.method;
    const table = await get(`/api/v1/experiments/${encodeURIComponent(experimentId)}/accuracy?method=${method}`);
    accuracyState.accuracyLoads += 1;
    if (method === accuracyState.method) { // the user may have switched method while this was computed
      accuracyState.table = table;
      accuracyState.signature = signature;
    }
  }
  if (!hasEvaluations) accuracyState.table = null;
  render();
  if (!accuracyState.drawn && accuracyState.table && evaluatedRuns(accuracyState.table).length > 1) {
    await plotlyReady();
    drawChart(accuracyState.table);
  }
  accuracyState.refreshes += 1;
}

async function tick() {
  accuracyState.failed = false;
  try {
    await refresh();
  } catch (err) {
    accuracyState.failed = err.status !== 404; // a deleted experiment will not come back: stop asking
    ensureLayout();
    const error = document.getElementById("accuracy-error");
    error.hidden = false;
    error.textContent = `Accuracy could not be loaded: ${err.message}`;
  }
}

// A running training run may succeed and start an automatic evaluation (eval_tasks): it is watched too.
function live() {
  return accuracyState.failed || accuracyState.runs.some((r) => LIVE_STATUSES.has(r.status))
    || [...accuracyState.evaluations.values()].flat().some((e) => LIVE_STATUSES.has(e.status));
}

// The panel in the page's one poller (poller.js).
export function mount() {
  if (panel) register({ name: "accuracy", refresh: tick, live });
}
