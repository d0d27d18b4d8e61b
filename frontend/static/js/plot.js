// The one plot module of the dashboard: the palette, the Plotly config every chart uses, and the loader of
// plotly.js (4.6 MB: loaded once, on demand, after a page's first API requests are on their way).
export const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#17becf", "#8c564b", "#e377c2",
  "#bcbd22", "#7f7f7f"];
export const BASELINE_COLOR = "#111111";
// No "Edit in Chart Studio"/"Share" (a cloud upload) and no Plotly logo on any chart.
export const PLOT_CONFIG = {
  responsive: true, displaylogo: false, showSendToCloud: false, showEditInChartStudio: false,
  modeBarButtonsToRemove: ["sendDataToCloud", "editInChartStudio"],
};

export function colorAt(index) {
  return PALETTE[index % PALETTE.length];
}

let loading = null;
export function loadPlotly() {
  if (!loading) {
    loading = window.Plotly ? Promise.resolve() : new Promise((resolve, reject) => {
      const url = document.querySelector("[data-plotly-url]")?.dataset.plotlyUrl || "/static/vendor/plotly.min.js";
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
