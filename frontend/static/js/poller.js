// One poller for a page: panels register { name, refresh, live, everyMs }, and one timer refreshes them – every
// POLL_MS, or a panel's own slower `everyMs` – for as long as any panel says it is live (`live()`), then stops.
// `poke()` refreshes everything now (after a user action). A panel's `refresh` handles its own errors.
export const POLL_MS = 2000;

const panels = [];
let timer = null;
let pass = null;

export function register(panel) {
  panels.push({ everyMs: POLL_MS, lastRun: -Infinity, ...panel });
  schedule(0);
}

export function poke() {
  for (const p of panels) p.lastRun = -Infinity;
  schedule(0);
}

export function polling() {
  return timer !== null || pass !== null;
}

function schedule(ms) {
  if (timer !== null) clearTimeout(timer);
  timer = setTimeout(run, ms);
}

async function run() {
  timer = null;
  if (pass) { await pass; return schedule(0); }
  const now = performance.now();
  const due = panels.filter((p) => now - p.lastRun >= p.everyMs - 50);
  for (const p of due) p.lastRun = now;
  pass = Promise.all(due.map((p) => p.refresh()));
  try { await pass; } finally { pass = null; }
  if (panels.some((p) => p.live())) schedule(Math.min(...panels.map((p) => p.everyMs)));
}
