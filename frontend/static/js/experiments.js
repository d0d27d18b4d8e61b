// Experiments list: name, created, recipes, run status counts and the one-line verdict (GET .../verdict, the same
// verdict as the experiment page and `plab demo`), filled in per row once the list is on screen.
import { get, items, formatDate, newestOnly, showGlobalError } from "./api.js";
import { html, joinHtml, setHTML, statusBadge, urlPath } from "./dom.js";
import { recipeName, statusCounts } from "./summary.js";
import { tagList } from "./housekeeping.js";
import { renderMarkdownLine } from "./markdown.js";

const PAGE = 50;
let offset = 0;
const loadTicket = newestOnly(); // a second search while the first loads: its answer must not land last

function experimentRecipes(exp, runs) {
  if (Array.isArray(exp.recipes) && exp.recipes.length) {
    return exp.recipes.map((r) => (typeof r === "string" ? r : r.name));
  }
  return [...new Set(runs.map(recipeName))];
}

function row(exp, runs) {
  const counts = exp.status_counts && typeof exp.status_counts === "object"
    ? exp.status_counts : statusCounts(runs);
  const countsHtml = Object.entries(counts)
    .filter(([, n]) => n > 0)
    .map(([status, n]) => html`${statusBadge(status)} <span class="count">${n}</span>`);
  return html`<tr data-experiment-id="${exp.id}">
    <td><a class="experiment-link" href="${urlPath("experiments", exp.id)}">${exp.name}</a>
      ${exp.archived_at && html` <span class="badge">archived</span>`}
      ${(exp.tags || []).length > 0 && html`<div class="tags">${tagList(exp.tags)}</div>`}
      ${exp.description && html`<div class="muted markdown">${renderMarkdownLine(exp.description)}</div>`}</td>
    <td>${formatDate(exp.created_at)}</td>
    <td>${joinHtml(experimentRecipes(exp, runs).map((r) => html`<code>${r}</code>`), " ")}</td>
    <td class="status-counts">${joinHtml(countsHtml, " ")}</td>
    <td class="summary" data-verdict-for="${exp.id}"></td>
  </tr>`;
}

async function load() {
  const body = document.getElementById("experiments-body");
  const current = loadTicket();
  try {
    const params = searchParams();
    params.set("limit", String(PAGE));
    params.set("offset", String(offset));
    const list = items(await get(`/api/v1/experiments?${params}`), "experiments");
    // The list may omit runs; fetch each experiment's detail then (a page holds at most PAGE).
    const details = await Promise.all(list.map((exp) => (Array.isArray(exp.runs)
      ? exp : get(`/api/v1/experiments/${encodeURIComponent(exp.id)}`).catch(() => exp))));
    if (!current()) return;
    setHTML(body, details.length
      ? joinHtml(details.map((exp) => row(exp, Array.isArray(exp.runs) ? exp.runs : [])))
      : searchParams().toString() ? html`<tr class="placeholder"><td colspan="5">No experiments match.</td></tr>`
        : html`<tr class="placeholder"><td colspan="5">No experiments yet:
           <a href="/experiments/new">create one</a>, or run <code>plab demo</code>.</td></tr>`);
    fillVerdicts(details);
    document.getElementById("experiments-prev").disabled = offset === 0;
    document.getElementById("experiments-next").disabled = list.length < PAGE;
    showGlobalError("");
  } catch (err) {
    if (!current()) return;
    setHTML(body, html`<tr class="placeholder"><td colspan="5">Could not load experiments.</td></tr>`);
    showGlobalError(err.message);
  }
}

// Each experiment's verdict, a few requests at a time (the server computes each from its runs' metrics); a row
// whose verdict cannot be had says so and the rest of the list is unaffected.
async function fillVerdicts(experiments) {
  const queue = experiments.filter((exp) => Array.isArray(exp.runs) && exp.runs.length);
  const worker = async () => {
    for (let exp = queue.shift(); exp; exp = queue.shift()) {
      const cell = document.querySelector(`td[data-verdict-for="${CSS.escape(String(exp.id))}"]`);
      try {
        const verdict = await get(`/api/v1/experiments/${encodeURIComponent(exp.id)}/verdict`);
        if (cell) cell.textContent = verdict.summary || "";
      } catch (err) {
        if (cell) cell.textContent = `verdict unavailable: ${err.message}`;
      }
    }
  };
  await Promise.all([worker(), worker(), worker()]);
}

// Search and the archived switch live in the URL, so a filtered list can be bookmarked.
function searchParams() {
  const params = new URLSearchParams();
  const q = document.getElementById("search-q").value.trim();
  const tag = document.getElementById("search-tag").value.trim();
  if (q) params.set("q", q);
  if (tag) params.set("tag", tag);
  if (document.getElementById("search-archived").checked) params.set("archived", "true");
  return params;
}

function readUrl() {
  const params = new URLSearchParams(window.location.search);
  document.getElementById("search-q").value = params.get("q") || "";
  document.getElementById("search-tag").value = params.get("tag") || "";
  document.getElementById("search-archived").checked = params.get("archived") === "true";
}

document.getElementById("experiment-search").addEventListener("submit", (event) => {
  event.preventDefault();
  offset = 0;
  const qs = searchParams().toString();
  window.history.replaceState(null, "", qs ? `?${qs}` : window.location.pathname);
  load();
});
document.getElementById("search-archived").addEventListener("change", () => {
  document.getElementById("experiment-search").requestSubmit();
});
document.getElementById("experiments-prev").addEventListener("click", () => {
  offset = Math.max(0, offset - PAGE);
  load();
});
document.getElementById("experiments-next").addEventListener("click", () => {
  offset += PAGE;
  load();
});
readUrl();
load();
