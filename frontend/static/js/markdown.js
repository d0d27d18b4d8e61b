// Markdown in descriptions and notes, as a tiny safe subset built from `html` templates (dom.js), so every
// character of the user's text still reaches the page escaped: paragraphs, line breaks, "- " lists, "#" headings
// (shown as h4), `code`, **bold**, *italic* and [links](https://...) with an http(s) target only. Anything else,
// raw HTML included, shows as the text it is.
import { html, joinHtml } from "./dom.js";

const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)|(\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\))/g;

function inline(text) {
  const parts = [];
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    parts.push(text.slice(last, m.index));
    if (m[1]) parts.push(html`<code>${m[1].slice(1, -1)}</code>`);
    else if (m[2]) parts.push(html`<strong>${m[2].slice(2, -2)}</strong>`);
    else if (m[3]) parts.push(html`<em>${m[3].slice(1, -1)}</em>`);
    else parts.push(html`<a href="${m[6]}" rel="noopener noreferrer nofollow" target="_blank">${m[5]}</a>`);
    last = m.index + m[0].length;
  }
  parts.push(text.slice(last));
  return joinHtml(parts);
}

function block(lines) {
  if (lines.every((l) => /^\s*[-*] /.test(l))) {
    return html`<ul>${lines.map((l) => html`<li>${inline(l.replace(/^\s*[-*] /, ""))}</li>`)}</ul>`;
  }
  const heading = lines.length === 1 && /^#{1,6} /.exec(lines[0]);
  if (heading) return html`<h4>${inline(lines[0].replace(/^#{1,6} /, ""))}</h4>`;
  return html`<p>${joinHtml(lines.map(inline), html`<br>`)}</p>`;
}

// `text` as safe markup (html`` output, for setHTML).
export function renderMarkdown(text) {
  const blocks = String(text ?? "").replace(/\r\n?/g, "\n").split(/\n\s*\n/)
    .map((b) => b.split("\n").filter((l) => l.trim() !== "")).filter((b) => b.length);
  return joinHtml(blocks.map(block));
}

// The first line of `text` as inline markup (list rows).
export function renderMarkdownLine(text) {
  return inline(String(text ?? "").split("\n").find((l) => l.trim()) || "");
}
