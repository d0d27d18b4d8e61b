// All runs across experiments, filtered by status, recipe and free text (the filters live in the URL so
// a filtered view can be bookmarked or shared).
import { get, items, formatDate, newestOnly, showGlobalError } from "./api.js";
import { html, joinHtml, setHTML, slurmNote, statusBadge, urlPath } from "./dom.js";
import { gemmBackend, runLabel } from "./summary.js";
import { tagList } from "./housekeeping.js";

const PAGE = 50;
const form = document.getElementById("runs-filters");
const fields = { status: "filter-status", recipe: "filter-recipe", q: "filter-q", tag: "filter-tag" };
const archivedBox = document.getElementById("filter-archived");
let offset = 0;
const loadTicket = newestOnly(); // a filter changed twice: the older list's answer must not land last

function readUrl() {
  const params = new URLSearchParams(window.location.search);
  for (const [name, id] of Object.entries(fields)) document.getElementById(id).value = params.get(name) || "";
  archivedBox.checked = params.get("archived") === "true";
  offset = Math.max(0, Number(params.get("offset")) || 0);
}

function query() {
  const params = new URLSearchParams();
  for (const [name, id] of Object.entries(fields)) {
    const v = document.getElementById(id).value.trim();
    if (v) params.set(name, v);
  }
  if (archivedBox.checked) params.set("archived", "true");
  return params;
}

function row(run) {
  const message = [run.status === "diverged" && run.diverged_step != null ? `diverged at step ${run.diverged_step}` : "",
    run.error_message || "", slurmNote(run)].filter(Boolean).join(": ");
  return html`<tr data-run-id="${run.id}" data-status="${run.status}">
    <td><a class="run-link" href="${urlPath("runs", run.id)}">#${run.id} ${runLabel(run)}</a>${run.external
      && html` <span class="badge record-only">record-only</span>`}${(run.tags || []).length > 0
      && html`<div class="tags">${tagList(run.tags)}</div>`}</td>
    <td><a href="${urlPath("experiments", run.experiment_id)}">experiment ${run.experiment_id}</a></td>
    <td><code>${run.recipe}</code></td>
    <td>${statusBadge(run.status)}</td>
    <td>${[run.device_name, run.worker_host].filter(Boolean).join(" @ ")}</td>
    <td>${gemmBackend(run)}</td>
    <td>${formatDate(run.created_at)}</td>
    <td class="run-message">${message}</td>
  </tr>`;
}

async function load() {
  const body = document.getElementById("runs-list-body");
  const params = query();
  params.set("limit", String(PAGE));
  params.set("offset", String(offset));
  const current = loadTicket();
  try {
    const data = await get(`/api/v1/runs?${params}`);
    if (!current()) return;
    const list = items(data, "runs");
    setHTML(body, list.length ? joinHtml(list.map(row))
      : html`<tr class="placeholder"><td colspan="8">No runs match these filters.</td></tr>`);
    const total = typeof data?.total === "number" ? data.total : null;
    document.getElementById("runs-total").textContent = total == null ? ""
      : `${offset + (list.length ? 1 : 0)}–${offset + list.length} of ${total}`;
    document.getElementById("runs-prev").disabled = offset === 0;
    document.getElementById("runs-next").disabled = total != null ? offset + list.length >= total : list.length < PAGE;
    showGlobalError("");
  } catch (err) {
    if (!current()) return;
    setHTML(body, html`<tr class="placeholder"><td colspan="8">Could not load runs.</td></tr>`);
    showGlobalError(err.message);
  }
}

function pushUrl() {
  const params = query();
  if (offset) params.set("offset", String(offset));
  const qs = params.toString();
  window.history.replaceState(null, "", qs ? `?${qs}` : window.location.pathname);
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  offset = 0;
  pushUrl();
  load();
});
form.addEventListener("change", () => { offset = 0; pushUrl(); load(); });
document.getElementById("runs-prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); pushUrl(); load(); });
document.getElementById("runs-next").addEventListener("click", () => { offset += PAGE; pushUrl(); load(); });
readUrl();
load();
