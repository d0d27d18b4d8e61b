"""Issue 6 acceptance run of the GEMM benchmark, one call on one GPU (about 4–6 minutes on an H100).

    python bench/gemm_bench.py                          # parts a, b, c
    python bench/gemm_bench.py --bf16-step-time 0.125   # Amdahl prediction for (b) from a measured step
    python bench/gemm_bench.py --anchor-train bf16,fp8_tensorwise   # + measured 1.14B training steps
    python bench/gemm_bench.py --smoke                  # tiny shapes, runs on CPU (checks the script)

(a) 8192×4096×14336: the tool's BF16 and FP8-tensorwise kernel-only TFLOP/s next to raw
    `hf_llama_anchor.py --gemm`-style timing (triton.testing.do_bench of `a @ b.t()` and
    `torch._scaled_mm(..., use_fast_accum=True)`), taken in this process before and after the tool;
    the bar is agreement within 5%. If `.devcarry/hf_llama_anchor.py` (or ../shared/tools/) exists, its own
    `gemm_table()` shapes are compared too.
(b) the 1.14B Llama of ANCHORS.md (batch 4 × 2048), all formats, both modes.
(c) CodonFM-5B (hidden 4096, ffn 16384, 24 layers, 32 heads, no GQA, plain non-gated MLP, vocab 128 –
    an assumption; its lm_head is left out of the comparison), micro-batch 31 × 512, FP8 current scaling
    and blockwise next to the published Transformer Engine figures (H200: 1.58× with quantization,
    1.90× kernel-only, blockwise 1.40× with quantization).

`--anchor-train` runs the anchor's training throughput (HF Llama, torch.compile) for the given recipes after
the GEMM parts; the BF16 step feeds the Amdahl prediction and the FP8 step gives the measured speedup it
is compared with (±0.10). Compiling the FP8 model takes over two minutes.

Writes the JSON as gemm_bench_<device>_<UTC time>.json to $OUT (when set) and bench/results/, then prints a
short table last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from training.gemm import FORMATS, run_gemm_benchmark  # noqa: E402
from training.gemm.predict import predict_speedup  # noqa: E402

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=32000)
CODONFM_5B = dict(hidden_size=4096, intermediate_size=16384, num_hidden_layers=24, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=128)
TE_H200 = {("fp8_tensorwise", "kernel"): 1.90, ("fp8_tensorwise", "quant"): 1.58,
           ("fp8_blockwise", "quant"): 1.40}
ANCHOR_SHAPE = (8192, 4096, 14336)
TOLERANCE = 0.05


def log(msg: str) -> None:
    print(f"[gemm_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def raw_anchor_style(m: int, k: int, n: int, device: torch.device) -> dict:
    """The timing of hf_llama_anchor.gemm_table for one shape (do_bench medians; perf_counter on CPU)."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=device)

    def fp8():
        return torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                use_fast_accum=device.type == "cuda")

    def bf16():
        return a @ b.t()

    if device.type == "cuda":
        import triton
        t_bf16 = triton.testing.do_bench(bf16, return_mode="median")
        t_fp8 = triton.testing.do_bench(fp8, return_mode="median")
    else:
        def bench(fn):
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(samples)
        t_bf16, t_fp8 = bench(bf16), bench(fp8)
    flop = 2 * m * k * n
    return {"bf16_tflops": flop / t_bf16 / 1e9, "fp8_tflops": flop / t_fp8 / 1e9}


def load_anchor():
    for path in (REPO / ".devcarry" / "hf_llama_anchor.py", REPO.parent / "shared" / "tools" / "hf_llama_anchor.py"):
        if path.exists():
            spec = importlib.util.spec_from_file_location("hf_llama_anchor", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module, str(path)
    return None, None


def tool_kernel_tflops(shape_text: str, device, repeats: int) -> dict:
    res = run_gemm_benchmark(shapes=shape_text, formats=["bf16", "fp8_tensorwise"], modes=["kernel"],
                             device=device, repeats=repeats, warmup=max(3, repeats // 5))
    out = {}
    for r in res["results"]:
        key = (r["m"], r["k"], r["n"])
        out.setdefault(key, {})["bf16" if r["format"] == "bf16" else "fp8"] = r["tflops"]
        if r["check"] in ("fail", "error"):
            out[key]["failure"] = r["note"] or f"rel error {r['rel_error']}"
    return out


def part_a(device, smoke: bool) -> dict:
    m, k, n = (256, 512, 384) if smoke else ANCHOR_SHAPE
    repeats = 5 if smoke else 50
    raw_before = raw_anchor_style(m, k, n, device)
    tool = tool_kernel_tflops(f"{m}x{k}x{n}", device, repeats)[(m, k, n)]
    raw_after = raw_anchor_style(m, k, n, device)
    rows = []
    for fmt, raw_key in (("bf16", "bf16_tflops"), ("fp8", "fp8_tflops")):
        raw = (raw_before[raw_key] + raw_after[raw_key]) / 2
        ratio = tool[fmt] / raw if tool.get(fmt) and raw else None
        rows.append({"shape": f"{m}x{k}x{n}", "format": "bf16" if fmt == "bf16" else "fp8_tensorwise",
                     "tool_tflops": tool.get(fmt), "raw_tflops": raw, "raw_before": raw_before[raw_key],
                     "raw_after": raw_after[raw_key], "ratio": ratio,
                     "within_5pct": ratio is not None and abs(ratio - 1) <= TOLERANCE})
    anchor_rows = []
    anchor, anchor_path = load_anchor()
    if anchor is not None and device.type == "cuda" and not smoke:
        table = anchor.gemm_table()  # the reference tool itself, on its own Llama shapes
        tool_all = tool_kernel_tflops(",".join(f"{r['m']}x{r['k']}x{r['n']}" for r in table), device, repeats)
        for r in table:
            t = tool_all[(r["m"], r["k"], r["n"])]
            for fmt, raw_key in (("bf16", "bf16_tflops"), ("fp8", "fp8_tflops")):
                ratio = t[fmt] / r[raw_key] if t.get(fmt) else None
                anchor_rows.append({"shape": f"{r['name']} {r['m']}x{r['k']}x{r['n']}", "format": fmt,
                                    "tool_tflops": t.get(fmt), "anchor_tflops": r[raw_key], "ratio": ratio,
                                    "within_5pct": ratio is not None and abs(ratio - 1) <= TOLERANCE})
    return {"rows": rows, "anchor_gemm_table": anchor_rows, "anchor_path": anchor_path,
            "tool_failure": tool.get("failure")}


def transformer_layer_speedup(result: dict, mode: str, fmt: str) -> float | None:
    """Speedup over the decoder-layer GEMMs only (TE's tool has no lm_head)."""
    t = result["totals"][mode]
    layers = [layer for layer in t["bf16"]["per_layer_s"] if layer != "lm_head"]
    if fmt not in t:
        return None
    fmt_s = sum(t[fmt]["per_layer_s"][layer] for layer in layers)
    return sum(t["bf16"]["per_layer_s"][layer] for layer in layers) / fmt_s if fmt_s else None


def run_anchor_training(recipes: list[str], smoke: bool) -> dict:
    anchor, path = load_anchor()
    if anchor is None:
        return {"error": "hf_llama_anchor.py not found in .devcarry/ or ../shared/tools/"}
    out = {"path": path}
    for recipe in recipes:
        log(f"anchor training 1b {recipe}")
        try:
            out[recipe] = anchor.train_throughput("1b", recipe, batch=4, seq=2048, steps=8, warmup=3)
        except Exception as exc:  # keep the GEMM results even when a training run cannot start
            out[recipe] = {"error": f"{type(exc).__name__}: {exc}"}
        torch.cuda.empty_cache()
    return out


def short_table(report: dict) -> str:
    lines = [f"device {report['device']}   torch {report['versions']['torch']}   "
             f"torchao {report['versions']['torchao']}   commit {report['git']['commit']}"]
    a = report.get("a")
    if a:
        lines.append("(a) kernel-only TFLOP/s, tool vs raw anchor-style timing in the same process (bar ±5%)")
        for r in a["rows"] + a["anchor_gemm_table"]:
            raw = r.get("raw_tflops", r.get("anchor_tflops"))
            ok = "ok" if r["within_5pct"] else "OUTSIDE 5%"
            tool = f"{r['tool_tflops']:.1f}" if r["tool_tflops"] else "-"
            ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
            lines.append(f"    {r['shape']:<28}{r['format']:<16}tool {tool:>8}  raw {raw:8.1f}  "
                         f"ratio {ratio}  {ok}")
    for part, title in (("b", "(b) 1.14B Llama, 4 x 2048"), ("c", "(c) CodonFM-5B, non-gated MLP, no GQA, 31 x 512")):
        res = report.get(part)
        if not res:
            continue
        lines.append(f"{title}: whole-step GEMM speedup vs BF16 (failed checks: {len(res['failures'])})")
        lines.append(f"    {'format':<16}{'kernel':>8}{'quant':>8}  {'backend':<10} predicted end-to-end (quant)")
        for fmt in res["formats"]:
            if fmt == "bf16":
                continue
            cells = []
            for mode in ("kernel", "quant"):
                t = res["totals"].get(mode, {}).get(fmt)
                cells.append(f"{t['speedup']:.2f}x" if t and t["speedup"] else "-")
            backends = sorted({str(r["backend"]) for r in res["results"] if r["format"] == fmt and r["backend"]})
            pred = res["prediction"].get("quant", {}).get(fmt)
            ptxt = f"{pred['speedup']:.2f}x ({pred['basis']})" if pred and pred["speedup"] else \
                (pred["note"] if pred else "-")
            lines.append(f"    {fmt:<16}{cells[0]:>8}{cells[1]:>8}  {','.join(backends):<10} {ptxt}")
    c = report.get("c_vs_te")
    if c:
        lines.append("(c) vs Transformer Engine (published, H200; ours on this device), decoder-layer GEMMs")
        for row in c:
            ours = f"{row['ours']:.2f}x" if row["ours"] else "-"
            lines.append(f"    {row['format']:<16}{row['mode']:<8} ours {ours:>7}   TE {row['te_h200']:.2f}x")
    tr = report.get("anchor_training")
    if tr and "bf16" in tr and "step_s" in tr.get("bf16", {}):
        lines.append(f"anchor training 1b: BF16 {tr['bf16']['tokens_per_s']:.0f} tok/s")
        for rec in tr:
            if rec not in ("path", "bf16") and "step_s" in tr.get(rec, {}):
                measured = tr["bf16"]["step_s"] / tr[rec]["step_s"]
                pred = report["b"]["prediction"]["quant"].get(rec, {}) if report.get("b") else {}
                ptxt = f"{pred['speedup']:.3f}" if pred.get("speedup") else "-"
                ok = "" if not pred.get("speedup") else \
                    ("within ±0.10" if abs(pred["speedup"] - measured) <= 0.10 else "OUTSIDE ±0.10")
                lines.append(f"    {rec}: measured {measured:.3f}x  predicted {ptxt}x  {ok}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="a,b,c", help="subset of a,b,c")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per GEMM in (b) and (c)")
    ap.add_argument("--bf16-step-time", type=float, default=None,
                    help="measured BF16 step (s) of the 1.14B config, batch 4 x 2048, on this device")
    ap.add_argument("--anchor-train", default="", help="e.g. bf16,fp8_tensorwise (slow: compiles models)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU allowed: checks the script only")
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts <= {"a", "b", "c"}:
        ap.error(f"--parts must be a subset of a,b,c, got {args.parts!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        ap.error("no CUDA GPU: this benchmark is for the H100 machine; use --smoke to check it on CPU")
    t_start = time.time()
    b_dims, c_dims = LLAMA_1B, CODONFM_5B
    b_batch, c_batch = (4, 2048), (31, 512)
    if args.smoke:
        b_dims = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
        c_dims = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=128)
        b_batch, c_batch = (1, 128), (1, 128)

    report: dict = {"errors": {}}

    def attempt(part: str, fn):
        # One part failing (a missing kernel, out of memory) must not cost the others their results.
        try:
            report[part] = fn()
        except Exception as exc:  # noqa: BLE001
            import traceback
            report["errors"][part] = f"{type(exc).__name__}: {exc}"
            log(f"part {part} failed:\n{traceback.format_exc()}")

    if "a" in parts:
        log("(a) anchor comparison 8192x4096x14336")
        attempt("a", lambda: part_a(device, args.smoke))
    if "b" in parts:
        log("(b) 1.14B Llama, all formats, both modes")
        attempt("b", lambda: run_gemm_benchmark(
            b_dims, micro_batch=b_batch[0], seq_len=b_batch[1], formats=FORMATS, modes=["kernel", "quant"],
            repeats=args.repeats, device=device, bf16_step_time_s=args.bf16_step_time,
            progress=lambda m: log(f"  (b) {m}")))
    if "c" in parts:
        log("(c) CodonFM-5B")
        attempt("c", lambda: run_gemm_benchmark(
            c_dims, micro_batch=c_batch[0], seq_len=c_batch[1], gated_mlp=False,
            formats=["bf16", "fp8_tensorwise", "fp8_blockwise"], modes=["kernel", "quant"],
            repeats=args.repeats, device=device, progress=lambda m: log(f"  (c) {m}")))
        if "c" in report:
            report["c_vs_te"] = [{"format": fmt, "mode": mode, "te_h200": te,
                                  "ours": transformer_layer_speedup(report["c"], mode, fmt)}
                                 for (fmt, mode), te in TE_H200.items()]
    recipes = [r.strip() for r in args.anchor_train.split(",") if r.strip()]
    if recipes and not args.smoke:
        report["anchor_training"] = tr = run_anchor_training(recipes, args.smoke)
        if "b" in report and "step_s" in tr.get("bf16", {}):
            # Re-predict (b) with the BF16 step measured in this same call.
            res = report["b"]
            bf16_total = res["totals"]["quant"]["bf16"]["total_s"]
            res["bf16_step_time_s"] = tr["bf16"]["step_s"]
            res["prediction"] = {mode: {fmt: predict_speedup(bf16_total, t["total_s"], tr["bf16"]["step_s"])
                                        for fmt, t in res["totals"][mode].items() if fmt != "bf16"}
                                 for mode in res["totals"]}

    any_res = next((report[p] for p in ("b", "c") if p in report), None) or run_gemm_benchmark(
        shapes="16x16x16", formats=["bf16"], modes=["kernel"], device=device, repeats=1, warmup=0)
    report.update(device=any_res["device"]["name"], versions=any_res["versions"], git=any_res["git"],
                  created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  wall_s=round(time.time() - t_start, 1), smoke=args.smoke)
    text = json.dumps(report, indent=1, default=str)
    slug = re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")
    name = f"gemm_bench_{'smoke_' if args.smoke else ''}{slug}_{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M}.json"
    # Same name under $OUT and bench/results/, so the file fetched from the GPU machine is copied as is.
    targets = [Path(os.environ["OUT"]) / name] if os.environ.get("OUT") else []
    if not args.smoke:
        targets.append(REPO / "bench" / "results" / name)
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        log(f"wrote {path}")
    print(short_table(report), flush=True)
    for part, err in report["errors"].items():
        print(f"part {part} FAILED: {err}", flush=True)
    failures = sum(len(report[p]["failures"]) for p in ("b", "c") if p in report)
    return 1 if failures or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
