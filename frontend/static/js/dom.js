// The one path from data to the page. `html`...`` escapes every interpolated value – text and attribute
// contexts alike (& < > " ' ` become entities) – unless the value is itself `html` output (or an array of
// values, each treated the same way); `false`, `null` and `undefined` render as nothing. `setHTML(el, safe)`
// is the only place the dashboard assigns markup, and it takes nothing but `html` output, so a value from
// the API can only ever reach the page as text. Everything else sets `textContent`.
// URLs built from data go through `urlPath` (path segments percent-encoded; never a scheme from data).

class SafeHtml {
  constructor(text) { this.text = text; }
  toString() { return this.text; }
}

const ENTITIES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;", "`": "&#96;" };

export function escapeHtml(value) {
  return String(value ?? "").replace(/[&<>"'`]/g, (c) => ENTITIES[c]);
}

function piece(value) {
  if (value instanceof SafeHtml) return value.text;
  if (Array.isArray(value)) return value.map(piece).join("");
  if (value === false || value == null) return "";
  return escapeHtml(value);
}

export function html(strings, ...values) {
  let out = strings[0];
  values.forEach((value, i) => { out += piece(value) + strings[i + 1]; });
  return new SafeHtml(out);
}

// Joins `html` pieces (or values, escaped) with a separator that is itself markup, e.g. joinHtml(cells, html`<br>`).
export function joinHtml(parts, separator = "") {
  const sep = piece(separator);
  return new SafeHtml(parts.map(piece).join(sep));
}

export function setHTML(element, safe) {
  if (!(safe instanceof SafeHtml)) throw new TypeError("setHTML takes html`...` output only");
  element.innerHTML = safe.text;
}

// "/experiments/" + encoded id: a link target that data can only fill with path segments.
export function urlPath(...segments) {
  return "/" + segments.map((s) => encodeURIComponent(String(s))).join("/");
}

export function statusBadge(status) {
  const s = String(status || "unknown");
  return html`<span class="badge status-${s}" data-status="${s}">${s}</span>`;
}

// Where a run waits or runs on a Slurm cluster (summary.slurm, written by the Slurm worker): "Slurm job 42:
// PENDING (Priority)"; empty for runs of local workers and for finished runs.
export function slurmNote(run) {
  const slurm = run && run.summary && run.summary.slurm;
  if (!slurm || !["queued", "running"].includes(run.status)) return "";
  const reason = slurm.reason && slurm.reason !== "None" ? ` (${slurm.reason})` : "";
  return `Slurm job ${slurm.job_id}: ${slurm.state}${reason}`;
}

// Plotly renders trace names, category labels, titles and hover text as its own small subset of HTML: data
// going there is escaped too. Plotly turns numeric entities and only a few named ones (&amp; &lt; &gt;) back into
// the characters on screen, so quotes become numeric entities here (`&quot;` showed as those six characters).
const PLOT_ENTITIES = { ...ENTITIES, '"': "&#34;" };

export function plotText(value) {
  return String(value ?? "").replace(/[&<>"'`]/g, (c) => PLOT_ENTITIES[c]);
}

// Control forms (`<form data-no-submit>`) never submit: Enter in one of their fields must not reload the page.
// A listener instead of an inline `onsubmit` attribute, which the Content-Security-Policy forbids.
document.addEventListener("submit", (event) => {
  if (event.target instanceof HTMLFormElement && event.target.hasAttribute("data-no-submit")) event.preventDefault();
}, true);
