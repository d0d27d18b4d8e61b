// Thin client of the REST API (/api/v1). On a server with a token, the browser is signed in by an HttpOnly
// session cookie (scripts never see a token: signIn() hands the pasted token to the server once and forgets it);
// writes made with the cookie carry the CSRF value the server gives this page.

export const API = "/api/v1";
const WRITE_METHODS = new Set(["POST", "PUT", "PATCH", "DELETE"]);
let sessionPromise = null;

try { window.localStorage.removeItem("plab-api-token"); } catch { /* no storage: nothing to clean up */ }

// {auth_required, authenticated, scope, csrf}; fetched once per page, refreshed by signIn/signOut.
export function session(refresh = false) {
  if (!sessionPromise || refresh) {
    sessionPromise = fetch(`${API}/session`, { headers: { Accept: "application/json" } })
      .then((r) => (r.ok ? r.json() : { auth_required: true, authenticated: false }))
      .catch(() => ({ auth_required: true, authenticated: false }));
  }
  return sessionPromise;
}

export async function signIn(token) {
  const value = (token || "").trim();
  const response = await fetch(`${API}/session`, {
    method: "POST", headers: { Accept: "application/json", Authorization: `Bearer ${value}` },
  });
  const data = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, errorMessage(data, response.status), data);
  sessionPromise = Promise.resolve(data);
  return data;
}

export async function signOut() {
  await fetch(`${API}/session`, { method: "DELETE" });
  return session(true);
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
  if (WRITE_METHODS.has(method)) {
    const current = await session();
    if (current.csrf) headers["X-CSRF-Token"] = current.csrf;
  }
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
      message += " (this server needs an API token for writes: sign in under \"API token\" at the top)";
    }
    throw new ApiError(response.status, message, data);
  }
  return data;
}

export const get = (path) => request("GET", path);

// Answers can arrive out of order (a filter changed, or a zoom, while the previous request was in flight): a
// loader takes a ticket per request and applies an answer only while its ticket is still the newest.
// `const ticket = newestOnly();` then per request `const current = ticket();` ... `if (!current()) return;`.
export function newestOnly() {
  let newest = 0;
  return () => {
    const mine = ++newest;
    return () => mine === newest;
  };
}
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
