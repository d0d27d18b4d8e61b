// The housekeeping box of an experiment or a run page: tags, notes (safe Markdown), editable name and
// description, archive/restore and delete (confirmed; the API removes the metrics and files). Every write goes
// through the API, which asks for a write-scope token where the server has one.
import { request, showGlobalError } from "./api.js";
import { html, joinHtml, setHTML } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

export function tagList(tags) {
  return joinHtml((tags || []).map((t) => html`<span class="tag">${t}</span>`), " ");
}

function parseTags(text) {
  return text.split(",").map((t) => t.trim()).filter(Boolean);
}

// kind: "experiments" | "runs"; nameField: "name" | "label"; onSaved(object) after a write, onDeleted() after a
// delete. Returns { update(object) } to redraw with fresh data.
export function mountHousekeeping(container, { kind, nameField, hasDescription, onSaved, onDeleted, describe }) {
  let current = null;
  let editing = false;
  const path = () => `/api/v1/${kind}/${encodeURIComponent(current.id)}`;

  function view() {
    const archived = Boolean(current.archived_at);
    setHTML(container, html`
      <div class="panel-head"><h2>Notes and tags</h2>
        <div class="hk-actions">
          <button type="button" id="hk-edit">Edit</button>
          <button type="button" id="hk-archive">${archived ? "Restore" : "Archive"}</button>
          <button type="button" id="hk-delete" class="danger">Delete</button>
        </div></div>
      ${archived && html`<p class="hint" id="hk-archived">Archived: hidden from the lists unless you ask for archived
        items. Restore brings it back.</p>`}
      <div id="hk-tags" class="tags">${(current.tags || []).length ? tagList(current.tags)
        : html`<span class="muted">no tags</span>`}</div>
      <div id="hk-notes" class="markdown">${current.notes ? renderMarkdown(current.notes)
        : html`<p class="muted">No notes yet.</p>`}</div>`);
  }

  function form() {
    setHTML(container, html`
      <h2>Edit</h2>
      <form id="hk-form" class="experiment-form hk-form" data-no-submit>
        <label>${nameField === "label" ? "Label" : "Name"} <input id="hk-name" maxlength="200"
          value="${current[nameField] || ""}"></label>
        ${hasDescription && html`<label>Description (Markdown) <textarea id="hk-description" rows="3"
          maxlength="10000">${current.description || ""}</textarea></label>`}
        <label>Tags (comma-separated) <input id="hk-tags-input" value="${(current.tags || []).join(", ")}"></label>
        <label>Notes (Markdown) <textarea id="hk-notes-input" rows="5" maxlength="20000">${current.notes || ""}</textarea></label>
        <p id="hk-error" class="form-error" role="alert" hidden></p>
        <div class="actions"><button type="submit" class="primary" id="hk-save">Save</button>
          <button type="button" id="hk-cancel">Cancel</button></div>
      </form>`);
  }

  function draw() {
    if (!current) return;
    if (editing) form(); else view();
  }

  async function write(method, body) {
    try {
      const answer = await request(method, path(), body);
      showGlobalError("");
      return answer ?? true;
    } catch (err) {
      const where = document.getElementById("hk-error");
      if (where && editing) { where.textContent = err.message; where.hidden = false; } else showGlobalError(err.message);
      return null;
    }
  }

  container.addEventListener("click", async (event) => {
    const id = event.target.closest("button")?.id;
    if (id === "hk-edit") { editing = true; draw(); }
    else if (id === "hk-cancel") { editing = false; draw(); }
    else if (id === "hk-archive") {
      const saved = await write("PATCH", { archived: !current.archived_at });
      if (saved) { current = saved; draw(); onSaved?.(saved); }
    } else if (id === "hk-delete") {
      const what = describe ? describe(current) : `${kind.slice(0, -1)} ${current.id}`;
      if (!window.confirm(`Delete ${what}? Its metrics, checkpoints and evaluations are deleted too. This cannot be undone.`)) return;
      if (await write("DELETE")) onDeleted?.();
    }
  });
  container.addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = { [nameField]: document.getElementById("hk-name").value.trim(),
      tags: parseTags(document.getElementById("hk-tags-input").value),
      notes: document.getElementById("hk-notes-input").value };
    if (hasDescription) body.description = document.getElementById("hk-description").value;
    const saved = await write("PATCH", body);
    if (saved) { current = saved; editing = false; draw(); onSaved?.(saved); }
  });

  return {
    update(object) {
      current = object;
      if (!editing) draw();
    },
  };
}
