// The one plot module of the dashboard: the palette, the Plotly config every chart uses, and the loader of
// plotly.js (4.6 MB: loaded once, on demand, after a page's first API requests are on their way).
export const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#17becf", "#8c564b", "#e377c2",
  "#bcbd22", "#7f7f7f"];
export const BASELINE_COLOR = "#111111";
// No "Edit in Chart Studio"/"Share" (a cloud upload) and no Plotly logo on any chart; the mode bar shows on hover
// only (always shown, it covered the titles of the run page's small charts).
export const PLOT_CONFIG = {
  responsive: true, displaylogo: false, showSendToCloud: false, showEditInChartStudio: false, displayModeBar: "hover",
  modeBarButtonsToRemove: ["sendDataToCloud", "editInChartStudio"],
};

export function colorAt(index) {
  return PALETTE[index % PALETTE.length];
}

let loading = null;
export function loadPlotly() {
  if (!loading) {
    loading = window.Plotly ? Promise.resolve() : new Promise((resolve, reject) => {
      const url = document.querySelector("[data-plotly-url]")?.dataset.plotlyUrl || "/static/vendor/plotly-cartesian.min.js";
      const script = document.createElement("script");
      script.src = url;
      script.onload = () => { performance.mark("plab:plotly-ready"); resolve(); };
      script.onerror = () => { loading = null; reject(new Error(`could not load plotly.js from ${url}`)); };
      document.head.appendChild(script);
    });
  }
  return loading;
}

export const plotlyReady = loadPlotly;

// Smoothing the curves start with (an EMA weight, see series.js): enough to read a noisy loss, little enough lag
// to see a spike, which stays visible in the faint raw curve drawn behind.
export const DEFAULT_SMOOTHING = 0.6;
const MIN_SMOOTHED_POINTS = 10;

// One series as drawn on every line chart: the smoothed curve, and behind it the raw one, faint and in the same
// legend group (hiding one hides both). With smoothing 0 only the raw curve, at full strength.
const SCHEDULE_KEY = /(^|\/)(lr|learning_rate)$/;

export function smoothedTraces({ name, x, y, color, smoothing: weight, width = 1.6, meta = {} }, ema) {
  // A handful of points (validation every N steps) is drawn as it is: an EMA over them would only lag. So is a
  // schedule (the learning rate): it is exact, and an EMA would move its warm-up peak.
  const schedule = SCHEDULE_KEY.test(meta.key ?? "");
  const smoothing = (y || []).length >= MIN_SMOOTHED_POINTS && !schedule ? weight : 0;
  const group = `${meta.run_id ?? name}|${meta.key ?? ""}`;
  const main = { type: "scatter", mode: "lines", name, x, y: smoothing > 0 ? ema(y, smoothing) : y,
    line: { color, width }, legendgroup: group, meta: { ...meta, smoothed: smoothing > 0 } };
  if (!(smoothing > 0)) return [main];
  return [{ type: "scatter", mode: "lines", name, x, y, line: { color, width: 1 }, opacity: 0.25, hoverinfo: "skip",
    showlegend: false, legendgroup: group, meta: { ...meta, raw: true } }, main];
}

// Bars of runs on emulated GEMMs carry this hatch on every chart: white stripes laid over the bar's own colour
// ("overlay"; the default "replace" draws the stripes on a transparent bar, which shows nothing when they are
// white), in the legend too.
// A horizontal legend under the plot, at the bottom of the figure (not at a fraction of the plot's height, which on a
// short or narrow chart put it over the x-axis title); the axis it sits under needs `automargin: true`.
export const BOTTOM_LEGEND = Object.freeze({ orientation: "h", x: 0, xanchor: "left", y: 0, yanchor: "bottom",
  yref: "container" });

export function emulatedPattern(emulated) {
  const shapes = Array.isArray(emulated) ? emulated.map((e) => (e ? "/" : "")) : (emulated ? "/" : "");
  return { shape: shapes, fillmode: "overlay", fgcolor: "#ffffff", fgopacity: 1, size: 8, solidity: 0.3 };
}
