// Export of the experiment page, independent of what the view shows: CSV and JSON are the API's full-resolution
// export (every stored point, streamed: GET /experiments/{id}/export), never the zoomed or downsampled curves on
// screen; the HTML report holds every panel drawn on the page at its full range (zoom undone, the loss curves
// re-read without a zoom window), plus the verdict line, the runs and accuracy tables.
import { get, items } from "./api.js";
import { escapeHtml, urlPath } from "./dom.js";
import { ema, relativeWallTime } from "./series.js";

// Every chart the report may hold, in page order; charts not drawn (or hidden) are left out.
export const REPORT_CHARTS = ["loss-chart", "val-loss-chart", "relative-chart", "throughput-chart", "memory-chart",
  "accuracy-delta-chart", "gemm-chart-kernel", "gemm-chart-quant", "numerics-chart"];
const LOSS_CHARTS = new Set(["loss-chart", "val-loss-chart"]);

function download(name, type, content) {
  const url = URL.createObjectURL(new Blob([content], { type }));
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

// Loss series of every run over the whole run (no x window), as the page would draw them unzoomed.
async function fullRangeLoss(experimentId, x) {
  const params = new URLSearchParams({ keys: "train/loss,val/loss", max_points: "2000", x });
  const data = await get(`/api/v1/experiments/${encodeURIComponent(experimentId)}/series?${params}`);
  const byRun = new Map();
  for (const r of items(data, "runs")) byRun.set(r.run_id, r.series || {});
  return byRun;
}

function unzoomed(layout) {
  const out = JSON.parse(JSON.stringify(layout || {}));
  delete out.uirevision;
  for (const name of Object.keys(out)) {
    if (/^[xy]axis\d*$/.test(name)) {
      delete out[name].range;
      out[name].autorange = true;
    }
  }
  return out;
}

function figure(id, fullLoss, x, smoothing) {
  const gd = document.getElementById(id);
  // Charts the page left out or collapsed to a one-line note (nothing to show) are left out of the report too.
  if (!gd || !gd.data || gd.hidden || gd.closest("[hidden]") || gd.closest(".collapsed")) return null;
  const data = gd.data.map((t) => {
    const trace = JSON.parse(JSON.stringify({ ...t, uid: undefined }));
    const meta = t.meta || {};
    const s = LOSS_CHARTS.has(id) && fullLoss.get(meta.run_id)?.[meta.key];
    if (s) {
      trace.x = x === "wall_time" ? relativeWallTime(s.wall_time || []) : (x === "tokens" ? s.tokens : s.step);
      trace.y = meta.smoothed && !meta.raw ? ema(s.value, smoothing) : s.value;
    }
    return trace;
  });
  return { id, data, layout: unzoomed(gd.layout) };
}

function tableHtml(selector) {
  const table = document.querySelector(selector);
  if (!table || table.closest("[hidden]")) return "";
  const copy = table.cloneNode(true);
  copy.querySelectorAll("button, input, select").forEach((el) => el.remove());
  return copy.outerHTML;
}

export async function reportHtml(experimentId, experiment) {
  const x = document.getElementById("x-axis")?.value || "step";
  const smoothing = Number(document.getElementById("smoothing")?.value || 0);
  const [plotly, fullLoss] = await Promise.all([
    fetch(document.querySelector("[data-plotly-url]").dataset.plotlyUrl).then((r) => r.text()),
    fullRangeLoss(experimentId, x),
  ]);
  const explorerCharts = [...document.querySelectorAll("#explorer-charts .chart")].map((el) => el.id);
  const figures = [...REPORT_CHARTS, ...explorerCharts].map((id) => figure(id, fullLoss, x, smoothing)).filter(Boolean);
  const safeJson = (obj) => JSON.stringify(obj).replace(/</g, "\\u003c");
  const name = experiment?.name || `experiment ${experimentId}`;
  const verdict = document.getElementById("experiment-summary")?.textContent || "";
  return `<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>${escapeHtml(name)} · Precision Lab report</title>
<style>body{font-family:system-ui,sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:12px 0}
td,th{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left}.chart{height:420px}
.progress{display:none}</style>
<script>${plotly.replace(/<\/script/gi, "<\\/script")}</script></head>
<body><h1>${escapeHtml(name)}</h1>
<p>${escapeHtml(experiment?.description || "")}</p>
<h2>Verdict</h2><p id="report-verdict">${escapeHtml(verdict)}</p>
<p>${escapeHtml(document.getElementById("verdict-rule")?.textContent || "")}</p>
${tableHtml("#decision-table")}
<p>Exported ${escapeHtml(new Date().toISOString())}, every chart at its full range. Emulated runs (hatched bars) ran
quantize → dequantize → BF16 GEMMs: their throughput is not the format's hardware throughput.</p>
${figures.map((f) => `<div id="${escapeHtml(f.id)}" class="chart"></div>`).join("\n")}
${tableHtml("#runs-table")}
${tableHtml("#accuracy-panel table")}
<script>const FIGURES = ${safeJson(figures)};
for (const f of FIGURES) Plotly.newPlot(f.id, f.data, f.layout, {displaylogo: false, showSendToCloud: false});</script>
</body></html>`;
}

// Wires #export-csv/#export-json (links to the API's streamed export) and #export-html.
export function mount(experimentId, experimentOf, onError) {
  const base = `/api/v1${urlPath("experiments", experimentId, "export")}`;
  for (const format of ["csv", "json"]) {
    const link = document.getElementById(`export-${format}`);
    link.href = `${base}?format=${format}`;
    link.setAttribute("download", `experiment-${experimentId}.${format}`);
  }
  document.getElementById("export-html").addEventListener("click", () => {
    reportHtml(experimentId, experimentOf()).then(
      (doc) => download(`experiment-${experimentId}.html`, "text/html", doc),
      (err) => onError(`HTML export failed: ${err.message}`));
  });
}
