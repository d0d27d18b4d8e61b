// Reading run records: the fields a run carries per docs/INTERFACES.md, with the few places where a
// value may sit (top level or inside `summary`) resolved once, here.

export const BASELINE = "bf16";

export function runSummary(run) {
  return (run && typeof run.summary === "object" && run.summary) || {};
}

export function recipeName(run) {
  if (!run) return "";
  if (typeof run.recipe === "string") return run.recipe;
  if (run.recipe && typeof run.recipe === "object") return run.recipe.name || "";
  return run.recipe_name || "";
}

export function runLabel(run) {
  if (run.label) return run.label;
  const recipe = recipeName(run);
  const first = run.bf16_first_layers ?? run.spec?.bf16_first_layers ?? 0;
  const last = run.bf16_last_layers ?? run.spec?.bf16_last_layers ?? 0;
  const keep = [];
  if (first) keep.push(`first ${first}`);
  if (last) keep.push(`last ${last}`);
  return keep.length && recipe !== BASELINE ? `${recipe} (BF16 ${keep.join(", ")})` : recipe;
}

function finite(x) {
  const v = typeof x === "string" ? Number(x) : x;
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

export function finalLoss(run) {
  const s = runSummary(run);
  return finite(run.final_loss) ?? finite(s.final_loss) ?? finite(s.final_train_loss) ?? finite(s.loss);
}

export function tokensPerSecond(run) {
  const s = runSummary(run);
  return finite(s.tokens_per_s) ?? finite(run.tokens_per_s);
}

export function peakMemory(run) {
  const s = runSummary(run);
  return finite(s.peak_mem_gib) ?? finite(run.peak_mem_gib);
}

// How every MFU figure is computed (training/flops.py): stated where MFU is shown.
export const MFU_CONVENTION = "Model FLOPs utilization: model FLOPs per token (6 x matmul weights, LM head included, "
  + "+ attention with the causal T x T matrix counted whole - T x window in a sliding-window layer, none in a "
  + "linear-attention layer - PaLM's and nanoGPT's convention) x tokens/s, over the GPU's dense BF16 peak - for "
  + "every recipe, FP8 and emulated ones too, so a faster format shows as a higher MFU; activation checkpointing's "
  + "recomputed forwards are not counted (model, not hardware, FLOPs)";

// MFU is a fraction of the peak (the API's summary.mfu, perf/mfu); above 1 is possible for a format faster than
// BF16's peak, so it is never read as a percentage.
export function mfuPercent(fraction) {
  return fraction == null ? null : 100 * fraction;
}

export function mfu(run) {
  const s = runSummary(run);
  return finite(s.mfu) ?? finite(run.mfu);
}

export function gemmBackend(run) {
  return run.gemm_backend || runSummary(run).gemm_backend || "";
}

// Progress as a fraction in [0, 1], or null when the run has not reported any. Workers send either a
// fraction, a percentage, or {step, total_steps}.
export function progressFraction(run) {
  if (run.status === "succeeded") return 1;
  const p = run.progress;
  if (p && typeof p === "object") {
    const step = finite(p.step), total = finite(p.total_steps ?? p.total ?? p.steps);
    if (step != null && total) return Math.min(1, Math.max(0, step / total));
    const f = finite(p.fraction);
    return f == null ? null : Math.min(1, Math.max(0, f));
  }
  const v = finite(p);
  if (v == null) return null;
  return Math.min(1, Math.max(0, v > 1 ? v / 100 : v));
}

// A running run that is still tokenizing its corpus: {fraction, text} from the worker's latest
// `data_progress` (training.shards.DataProgress), or null once training started or for any other run.
export function dataPreparation(run) {
  const p = runSummary(run).data_progress;
  if (run.status !== "running" || !p || typeof p !== "object" || p.done) return null;
  const fraction = finite(p.fraction);
  const parts = [String(p.phase || "preparing data")];
  const docs = finite(p.documents), tps = finite(p.tokens_per_s), eta = finite(p.eta_s);
  if (docs != null) parts.push(`${docs.toLocaleString()} document${docs === 1 ? "" : "s"}`);
  if (tps != null) parts.push(`${compactNumber(tps)} tokens/s`);
  if (eta != null) parts.push(eta < 90 ? `${Math.round(eta)} s left` : `${Math.round(eta / 60)} min left`);
  return {fraction: fraction == null ? null : Math.min(1, Math.max(0, fraction)), text: parts.join(" · ")};
}

// What a run trains on (training.shards' meta, in the run summary's `data` from its start), one line.
export function dataSummary(run) {
  const d = runSummary(run).data;
  if (!d || typeof d !== "object") return "";
  const parts = [];
  const files = finite(d.files), docs = finite(d.documents_train), tokens = finite(d.tokens_train);
  if (files != null) parts.push(`${files.toLocaleString()} file${files === 1 ? "" : "s"}`);
  if (docs != null) {
    const all = docs + (finite(d.documents_val) || 0);
    parts.push(`${compactNumber(all)} document${all === 1 ? "" : "s"}`);
  }
  if (tokens != null) parts.push(`${compactNumber(tokens)} training tokens`);
  if (typeof d.tokenizer === "string") parts.push(`tokenizer ${d.tokenizer}`);
  const bad = finite(d.bad_lines);
  if (bad) parts.push(`${bad.toLocaleString()} bad line${bad === 1 ? "" : "s"} skipped`);
  // data.val_corpus files and documents the training corpus holds too: validation partly on trained text
  const valFiles = finite(d.val_files_in_train);
  if (valFiles) {
    parts.push(valFiles === 1 ? "1 validation file is a training file"
      : `${valFiles.toLocaleString()} validation files are training files`);
  }
  const shared = finite(d.val_documents_in_train);
  if (shared) {
    const of = finite(d.documents_val);
    parts.push(`${shared.toLocaleString()}${of ? ` of ${of.toLocaleString()}` : ""} validation document`
      + `${(of || shared) === 1 ? "" : "s"} also in the training corpus`);
  }
  return parts.join(" · ");
}

function compactNumber(v) {
  for (const [scale, unit] of [[1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (Math.abs(v) >= scale) return `${(v / scale).toFixed(1)}${unit}`;
  }
  return String(Math.round(v));
}

export function statusCounts(runs) {
  const counts = {};
  for (const run of runs) counts[run.status] = (counts[run.status] || 0) + 1;
  return counts;
}
