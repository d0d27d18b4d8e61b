// What the experiment page says about its state: which runs are live (polled), the one-line status, whether a
// queued run has a worker to run it, and panels with nothing to show collapsed to one line.
import { get, LIVE_STATUSES } from "./api.js";

// Runs whose status can still change through a worker. Record-only runs are reported by the user's own script
// and may stay "running" forever: they are not polled.
export function liveRuns(runs) {
  return runs.filter((r) => LIVE_STATUSES.has(r.status) && !r.external);
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

export function statusLine(runs, polling, workerNoteText = "") {
  if (!runs.length) return "this experiment has no runs";
  const live = liveRuns(runs);
  if (polling && live.length) {
    return `${plural(live.length, "run")} live · updating every 2 s${workerNoteText ? ` · ${workerNoteText}` : ""}`;
  }
  const counts = {};
  for (const r of runs) counts[r.status] = (counts[r.status] || 0) + 1;
  const bad = (counts.failed || 0) + (counts.diverged || 0);
  const recordOnly = runs.filter((r) => r.external && LIVE_STATUSES.has(r.status)).length;
  const parts = Object.entries(counts).map(([s, n]) => `${n} ${s}`).join(", ");
  if (bad === runs.length) return `failed: every run ${runs.length === 1 ? "" : "failed or diverged "}(${parts})`;
  if (bad) return `finished with failures: ${parts}`;
  if (recordOnly) return `${parts} · record-only runs are updated by their own script, not polled`;
  return counts.succeeded === runs.length ? "all runs finished" : `finished: ${parts}`;
}

// "no worker …" when queued worker runs exist and no live worker serves the experiment's queue (workers register
// every 30 s; the API counts one live for 90 s), else "".
export async function workerNote(experiment, runs) {
  const queued = runs.filter((r) => r.status === "queued" && !r.external);
  if (!queued.length) return "";
  const queue = (experiment?.training || {}).queue || "default";
  let workers;
  try {
    workers = await get("/api/v1/workers");
  } catch {
    return "";
  }
  const serving = (Array.isArray(workers) ? workers : []).filter((w) => w.live && (w.queues || []).includes(queue));
  return serving.length ? "" : `${plural(queued.length, "run")} queued with no worker on queue '${queue}' (none has `
    + "registered in the last 90 s): start one with `plab worker`";
}

// The panel holding `chartId` shrinks to its title and one line saying why it is empty (`note`), or opens again
// (`note` empty). Plotly sizes a chart drawn while hidden wrongly, so it is resized when the panel opens.
export function collapsePanel(chartId, note, { keepControls = false } = {}) {
  const chart = document.getElementById(chartId);
  const panel = chart?.closest(".panel");
  if (!panel) return;
  let line = panel.querySelector(":scope > .one-line.empty-note");
  if (!line) {
    line = document.createElement("p");
    line.className = "muted one-line empty-note";
    panel.appendChild(line);
  }
  const was = panel.classList.contains("collapsed");
  panel.classList.toggle("collapsed", Boolean(note));
  panel.classList.toggle("keep-controls", keepControls);
  line.textContent = note || "";
  line.hidden = !note;
  if (was && !note && window.Plotly) {
    panel.querySelectorAll(".js-plotly-plot").forEach((gd) => window.Plotly.Plots.resize(gd));
  }
}
