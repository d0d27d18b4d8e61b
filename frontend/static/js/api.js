// Thin client of the REST API (/api/v1). Writes carry the user's bearer token when one is stored.

export const API = "/api/v1";
const TOKEN_KEY = "plab-api-token";

export function getToken() {
  try { return window.localStorage.getItem(TOKEN_KEY) || ""; } catch { return ""; }
}

export function setToken(token) {
  const value = (token || "").trim();
  if (value) window.localStorage.setItem(TOKEN_KEY, value);
  else window.localStorage.removeItem(TOKEN_KEY);
}

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.body = body;
  }
}

// FastAPI answers {"detail": "..."} for HTTPException and {"detail": [{loc, msg}, ...]} for request
// validation; some handlers use {"message"} or {"error"}. Turn any of them into one readable line.
export function errorMessage(body, status) {
  if (body == null) return `HTTP ${status}`;
  if (typeof body === "string") return body || `HTTP ${status}`;
  const detail = body.detail ?? body.message ?? body.error ?? body.errors;
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) {
    return detail.map((d) => {
      if (typeof d === "string") return d;
      const loc = Array.isArray(d.loc) ? d.loc.filter((p) => p !== "body").join(".") : "";
      return loc ? `${loc}: ${d.msg ?? JSON.stringify(d)}` : (d.msg ?? JSON.stringify(d));
    }).join("; ");
  }
  if (detail && typeof detail === "object") return detail.message ?? JSON.stringify(detail);
  return `HTTP ${status}`;
}

export async function request(method, path, body) {
  const headers = { Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const token = getToken();
  if (token) headers.Authorization = `Bearer ${token}`;
  const response = await fetch(path.startsWith("/") ? path : `${API}/${path}`, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  let data = null;
  if (text) {
    try { data = JSON.parse(text); } catch { data = text; }
  }
  if (!response.ok) {
    let message = errorMessage(data, response.status);
    if (response.status === 401) {
      message += " (this server needs an API token for writes: paste it under \"API token\" at the top)";
    }
    throw new ApiError(response.status, message, data);
  }
  return data;
}

export const get = (path) => request("GET", path);
export const post = (path, body) => request("POST", path, body ?? {});

// List endpoints may answer a bare array or a page object; accept both so the pages do not care.
export function items(data, ...names) {
  if (Array.isArray(data)) return data;
  for (const name of [...names, "items", "results", "data"]) {
    if (data && Array.isArray(data[name])) return data[name];
  }
  return [];
}

export function showGlobalError(message) {
  const banner = document.getElementById("global-error");
  if (!banner) return;
  banner.textContent = message;
  banner.hidden = !message;
}

export { escapeHtml, statusBadge } from "./dom.js";

export function formatDate(value) {
  if (!value) return "";
  const d = new Date(value);
  if (Number.isNaN(d.getTime())) return String(value);
  return d.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" });
}

export const FINAL_STATUSES = new Set(["succeeded", "failed", "cancelled", "diverged"]);
export const LIVE_STATUSES = new Set(["queued", "running"]);


// experiment.js loads plotly.js (after its first requests); the panels wait for it rather than loading it twice.
export function plotlyReady(timeoutMs = 30_000) {
  return new Promise((resolve, reject) => {
    const start = performance.now();
    const check = () => {
      if (window.Plotly) resolve();
      else if (performance.now() - start > timeoutMs) reject(new Error("plotly.js did not load"));
      else setTimeout(check, 100);
    };
    check();
  });
}
