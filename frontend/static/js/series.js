// Pure functions on metric series (no DOM): smoothing, alignment, relative difference to the baseline.
// Kept separate so the browser tests can check them on synthetic series with known answers.

// Exponential moving average with bias correction (as TensorBoard's smoothing slider): weight 0 returns
// the input, weight → 1 smooths more. Bias correction keeps the first points from being dragged to 0.
export function ema(values, weight) {
  if (!(weight > 0)) return values.slice();
  if (weight >= 1) throw new RangeError(`smoothing weight must be in [0, 1), got ${weight}`);
  const out = new Array(values.length);
  let acc = 0, n = 0;
  for (let i = 0; i < values.length; i += 1) {
    const v = values[i];
    if (v == null || !Number.isFinite(v)) { out[i] = v; continue; }
    acc = acc * weight + (1 - weight) * v;
    n += 1;
    out[i] = acc / (1 - weight ** n);
  }
  return out;
}

// Points with a finite x and y, sorted by x, one value per x (the last one wins: min/max downsampling
// may send two points at the same x, and interpolation needs a function of x).
export function cleanPoints(xs, ys) {
  const pts = [];
  for (let i = 0; i < Math.min(xs.length, ys.length); i += 1) {
    const x = xs[i], y = ys[i];
    if (x != null && y != null && Number.isFinite(x) && Number.isFinite(y)) pts.push([x, y]);
  }
  pts.sort((a, b) => a[0] - b[0]);
  const x = [], y = [];
  for (const [px, py] of pts) {
    if (x.length && x[x.length - 1] === px) { y[y.length - 1] = py; continue; }
    x.push(px);
    y.push(py);
  }
  return { x, y };
}

// Linear interpolation of (xs, ys) at each of `at`; null outside [xs[0], xs[last]] (no extrapolation:
// a recipe that has not reached BF16's token count yet has no comparable loss there).
export function interpolate(xs, ys, at) {
  const out = new Array(at.length).fill(null);
  if (!xs.length) return out;
  let j = 0;
  for (let i = 0; i < at.length; i += 1) {
    const t = at[i];
    if (t < xs[0] || t > xs[xs.length - 1]) continue;
    while (j < xs.length - 2 && xs[j + 1] < t) j += 1;
    while (j > 0 && xs[j] > t) j -= 1;
    if (xs[j] === t || xs.length === 1) { out[i] = ys[j]; continue; }
    const x0 = xs[j], x1 = xs[j + 1], y0 = ys[j], y1 = ys[j + 1];
    out[i] = x1 === x0 ? y1 : y0 + ((y1 - y0) * (t - x0)) / (x1 - x0);
  }
  return out;
}

// Relative loss difference in percent, 100·(loss − baseline)/baseline, evaluated at the baseline's own
// x values (tokens), with the other run's loss linearly interpolated onto them.
export function relativeDifference(base, other) {
  const b = cleanPoints(base.x, base.y);
  const o = cleanPoints(other.x, other.y);
  const at = interpolate(o.x, o.y, b.x);
  const x = [], y = [];
  for (let i = 0; i < b.x.length; i += 1) {
    if (at[i] == null || b.y[i] === 0) continue;
    x.push(b.x[i]);
    y.push((100 * (at[i] - b.y[i])) / b.y[i]);
  }
  return { x, y };
}

// Wall time may be absolute (epoch seconds) or already relative: show seconds since the run started.
export function relativeWallTime(wallTimes) {
  const finite = wallTimes.filter((t) => t != null && Number.isFinite(t));
  if (!finite.length) return wallTimes.slice();
  const start = Math.min(...finite);
  return start > 1e8 ? wallTimes.map((t) => (t == null ? t : t - start)) : wallTimes.slice();
}

export function median(values) {
  const v = values.filter((x) => x != null && Number.isFinite(x)).sort((a, b) => a - b);
  if (!v.length) return null;
  const m = Math.floor(v.length / 2);
  return v.length % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}
