"""Acceptance run of the GEMM benchmark, one call on one GPU (budget: 7 minutes on an H100).

    python bench/gemm_bench.py                                  # parts a, b, c
    python bench/gemm_bench.py --train-bench bench/results/train_bench_....json
                                    # (b) predicted from that run's BF16 step, next to its measured speedups
    python bench/gemm_bench.py --step-times bf16=0.1314,fp8_tensorwise=0.1136   # the same, by hand
    python bench/gemm_bench.py --quick                          # ~2 min smoke: a (one shape), b (BF16, FP8-CS)
    python bench/gemm_bench.py --smoke                          # tiny shapes, runs on CPU (checks the script)

(a) 8192×4096×14336 (and the Llama shapes of `hf_llama_anchor.py --gemm`): the tool's kernel-only BF16 and
    FP8-tensorwise TFLOP/s next to raw `hf_llama_anchor.py --gemm`-style timing (triton.testing.do_bench,
    median, of `a @ b.t()` and `torch._scaled_mm(a8, b8.t(), unit scales, use_fast_accum=True)` on
    `randn` operands, FP8 by a plain unscaled cast). Measured interleaved - every round times each cell
    once, order reversed every other round - and compared as medians over rounds, so clock drift hits
    both sides alike. Two factors are separated, 2 × 2 cells per format:
      protocol: the tool's timing (training/gemm/timing.py) vs do_bench itself;
      operands: the tool's (rotated sets; FP8 quantized with an amax scale, values fill E4M3) vs the raw
                ones (one set; FP8 = randn cast unscaled, most values near 1).
    The acceptance ratio compares like with like: tool protocol / do_bench on the same operands (both
    operand kinds reported, both must be within 5%); `ratio_as_reported` (tool on its operands / raw on
    raw's) and the factor that explains it are printed too.
(b) the 1.14B Llama the reference anchor trains (batch 4 × 2048), all formats, both modes; the predicted end-to-end
    speedups (kernel-only = upper bound, with quantization = expected) next to measured ones when step
    times are given (±0.10 bar for FP8 tensorwise).
(c) CodonFM-5B (hidden 4096, ffn 16384, 24 layers, 32 heads, no GQA, plain non-gated MLP, vocab 128 –
    an assumption; its lm_head is left out of the comparison), micro-batch 31 × 512, FP8 current scaling
    and blockwise next to the published Transformer Engine figures (H200: 1.58× with quantization,
    1.90× kernel-only, blockwise 1.40× with quantization).

`--anchor-train` runs the anchor's training throughput (HF Llama, torch.compile) for the given recipes after
the GEMM parts (slow: compiling a float8 model takes minutes).

Writes the JSON (device, date, git commit - PLAB_GIT_COMMIT if set -, per-part wall times) as
gemm_bench_<device>_<UTC time>.json to $OUT (when set) and bench/results/, then prints a short table last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from training.gemm import FORMATS, GemmShape, run_gemm_benchmark  # noqa: E402
from training.gemm.benchmark import relative_error  # noqa: E402
from training.gemm.formats import make_operands, prepare  # noqa: E402
from training.gemm.predict import predictions  # noqa: E402
from training.gemm.timing import buffer_count, time_gemm  # noqa: E402

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=32000)
CODONFM_5B = dict(hidden_size=4096, intermediate_size=16384, num_hidden_layers=24, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=128)
TE_H200 = {("fp8_tensorwise", "kernel"): 1.90, ("fp8_tensorwise", "quant"): 1.58,
           ("fp8_blockwise", "quant"): 1.40}
ANCHOR_SHAPE = (8192, 4096, 14336)
# The shapes of hf_llama_anchor.gemm_table (name: m, k, n).
ANCHOR_TABLE_SHAPES = {"qkv_1b": (8192, 2048, 3072), "up_gate_1b": (8192, 2048, 16384),
                       "down_1b": (8192, 8192, 2048), "up_gate_8b": (8192, 4096, 28672)}
TOLERANCE = 0.05
SPEEDUP_BAR = 0.10
TOOL, DO_BENCH = "tool_protocol", "do_bench"
TOOL_OPS, RAW_OPS = "tool_operands", "raw_operands"


def log(msg: str) -> None:
    print(f"[gemm_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- part a
def do_bench_median_s(fn, device: torch.device) -> float:
    """hf_llama_anchor's timing: triton.testing.do_bench(fn, return_mode="median") (CPU: 5 wall-clock calls)."""
    if device.type == "cuda":
        import triton
        return triton.testing.do_bench(fn, return_mode="median") / 1e3
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def compare_shape(m: int, k: int, n: int, device: torch.device, rounds: int, seed: int = 0) -> list[dict]:
    """The 2 (protocol) × 2 (operands) cells per format for one shape, interleaved over `rounds`."""
    shape = GemmShape("custom", "fprop", m, k, n, 1)
    gen = torch.Generator(device=device).manual_seed(seed)
    n_buf = buffer_count(2 * (m * k + k * n), device)
    buffers = [make_operands(shape, device, gen) for _ in range(n_buf)]
    tool = {"bf16": prepare("bf16", shape, buffers, device),
            "fp8_tensorwise": prepare("fp8_tensorwise", shape, buffers, device)}
    # Exactly hf_llama_anchor.gemm_table's operands and calls.
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=device)
    raw = {"bf16": lambda: a @ b.t(),
           "fp8_tensorwise": lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                      use_fast_accum=device.type == "cuda")}
    ref_tool = tool["bf16"].run(0)
    checks = {"tool_fp8_rel_error_vs_bf16": relative_error(tool["fp8_tensorwise"].run(0), ref_tool),
              "raw_fp8_rel_error_vs_bf16": relative_error(raw["fp8_tensorwise"](), raw["bf16"]())}
    del ref_tool

    def measure(fmt: str, protocol: str, operands: str) -> float:
        if operands == TOOL_OPS:
            run, nb = tool[fmt].run, n_buf
        else:
            run, nb = (lambda i: raw[fmt]()), 1
        if protocol == TOOL:
            # do_bench's own counts (warmup=None, repeats=None), so both protocols warm up alike.
            return time_gemm(run, nb, device, warmup=None, repeats=None)["median_s"]
        counter = itertools.count()
        return do_bench_median_s(lambda: run(next(counter) % nb), device)

    # Reported (tool/tool) and raw (do_bench/raw) side by side, then the two crossed cells.
    cells = [(TOOL, TOOL_OPS), (DO_BENCH, RAW_OPS), (DO_BENCH, TOOL_OPS), (TOOL, RAW_OPS)]
    flop = 2 * m * k * n
    rows = []
    for fmt in ("bf16", "fp8_tensorwise"):
        per_round: dict = {c: [] for c in cells}
        for r in range(rounds):
            for cell in (cells if r % 2 == 0 else cells[::-1]):
                per_round[cell].append(flop / measure(fmt, *cell) / 1e12)
        med = {c: statistics.median(v) for c, v in per_round.items()}
        same_tool = med[(TOOL, TOOL_OPS)] / med[(DO_BENCH, TOOL_OPS)]
        same_raw = med[(TOOL, RAW_OPS)] / med[(DO_BENCH, RAW_OPS)]
        ops_do_bench = med[(DO_BENCH, TOOL_OPS)] / med[(DO_BENCH, RAW_OPS)]
        ops_tool = med[(TOOL, TOOL_OPS)] / med[(TOOL, RAW_OPS)]
        reported = med[(TOOL, TOOL_OPS)] / med[(DO_BENCH, RAW_OPS)]
        protocol_factor = math.sqrt(same_tool * same_raw)
        operand_factor = math.sqrt(ops_do_bench * ops_tool)
        bigger = "protocol" if abs(math.log(protocol_factor)) >= abs(math.log(operand_factor)) else "operands"
        rows.append({
            "shape": f"{m}x{k}x{n}", "format": fmt, "rounds": rounds, "buffers": n_buf,
            "tflops_median": {f"{p}|{o}": v for (p, o), v in med.items()},
            "tflops_per_round": {f"{p}|{o}": v for (p, o), v in per_round.items()},
            "tool_tflops": med[(TOOL, TOOL_OPS)], "raw_tflops": med[(DO_BENCH, RAW_OPS)],
            "ratio_as_reported": reported,
            "acceptance_ratio": same_tool, "acceptance_ratio_raw_operands": same_raw,
            "protocol_factor": protocol_factor, "operand_factor": operand_factor,
            "paired_round_ratio_median": statistics.median(
                t / r for t, r in zip(per_round[(TOOL, TOOL_OPS)], per_round[(DO_BENCH, TOOL_OPS)])),
            "explains": (f"tool/raw as reported {reported:.3f} = protocol {protocol_factor:.3f} × operands "
                         f"{operand_factor:.3f} (geometric means over the other factor); the larger is {bigger}"),
            "within_5pct": abs(same_tool - 1) <= TOLERANCE and abs(same_raw - 1) <= TOLERANCE,
            **({"checks": checks} if fmt == "fp8_tensorwise" else {}),
        })
    del buffers, tool, a, b, a8, b8
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def load_anchor():
    for path in (REPO / ".devcarry" / "hf_llama_anchor.py", REPO.parent / "shared" / "tools" / "hf_llama_anchor.py"):
        if path.exists():
            spec = importlib.util.spec_from_file_location("hf_llama_anchor", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module, str(path)
    return None, None


def part_a(device, smoke: bool, quick: bool, rounds: int) -> dict:
    main_shape = (128, 128, 128) if smoke else ANCHOR_SHAPE
    log(f"(a) {main_shape[0]}x{main_shape[1]}x{main_shape[2]}, {rounds} interleaved rounds")
    rows = compare_shape(*main_shape, device, rounds)
    table_rows = []
    if not (smoke or quick):
        for name, (m, k, n) in ANCHOR_TABLE_SHAPES.items():
            log(f"(a) anchor shape {name} {m}x{k}x{n}")
            table_rows += [{**r, "shape": f"{name} {r['shape']}"} for r in compare_shape(m, k, n, device, max(2, rounds - 2))]
    anchor, anchor_path = load_anchor()
    anchor_output = None
    if anchor is not None and device.type == "cuda" and not (smoke or quick):
        # The reference tool itself, once (not interleaved: for the record, not for the ratio).
        anchor_output = anchor.gemm_table()
    return {"rows": rows, "anchor_shapes": table_rows, "anchor_path": anchor_path,
            "anchor_gemm_table_output": anchor_output,
            "method": "interleaved rounds (order reversed every other round), medians over rounds; "
                      "acceptance = tool protocol / do_bench on the same operands, both operand kinds"}


# ------------------------------------------------------------------------------------------- b, c
def transformer_layer_speedup(result: dict, mode: str, fmt: str) -> float | None:
    """Speedup over the decoder-layer GEMMs only (TE's tool has no lm_head)."""
    t = result["totals"][mode]
    layers = [layer for layer in t["bf16"]["per_layer_s"] if layer != "lm_head"]
    if fmt not in t:
        return None
    fmt_s = sum(t[fmt]["per_layer_s"][layer] for layer in layers)
    return sum(t["bf16"]["per_layer_s"][layer] for layer in layers) / fmt_s if fmt_s else None


def run_anchor_training(recipes: list[str]) -> dict:
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


def parse_step_times(text: str) -> dict:
    out = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"--step-times item {item!r}: write recipe=seconds, e.g. bf16=0.1314") from None
        if not name.strip() or not seconds > 0:
            raise ValueError(f"--step-times item {item!r}: write recipe=seconds with positive seconds")
        out[name.strip()] = seconds
    if out and "bf16" not in out:
        raise ValueError("--step-times needs bf16=<seconds>: the prediction starts from the BF16 step")
    return out


def step_times_from_train_bench(path: Path) -> tuple[dict, str]:
    """Median step times per recipe of a bench/train_bench.py result for the 1.14B config (batch 4 × 2048,
    one GPU), and its device name."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--train-bench {path}: cannot read it as JSON ({exc})") from None
    out = {}
    for r in data.get("results", []):
        spec = r.get("spec", {})
        train, data_spec = spec.get("training", {}), spec.get("data", {})
        if (r.get("status") == "succeeded" and r.get("step_time_s") and spec.get("model") == "1b"
                and train.get("batch_size") == 4 and data_spec.get("seq_len") == 2048 and train.get("gpus", 1) == 1):
            out.setdefault(r.get("recipe") or r.get("label"), r["step_time_s"])
    if "bf16" not in out:
        raise ValueError(f"--train-bench {path}: no succeeded bf16 run of model 1b, batch 4 x 2048 on one GPU")
    return out, str(data.get("device", ""))


def compare_with_training(result: dict, step_times: dict, source: str) -> list[dict]:
    """Re-predict from the measured BF16 step and put each measured speedup next to both predictions."""
    result["bf16_step_time_s"] = step_times["bf16"]
    result["prediction"] = predictions(result["totals"], step_times["bf16"])
    rows = []
    for recipe, seconds in step_times.items():
        if recipe == "bf16":
            continue
        measured = step_times["bf16"] / seconds
        row = {"recipe": recipe, "measured_speedup": measured, "step_s": seconds, "bf16_step_s": step_times["bf16"],
               "source": source}
        for mode in ("kernel", "quant"):
            pred = result["prediction"].get(mode, {}).get(recipe)
            if pred and pred.get("speedup"):
                row[f"predicted_{mode}"] = pred["speedup"]
                row[f"error_{mode}"] = pred["speedup"] - measured
        if "predicted_quant" in row:
            row["within_0.10"] = abs(row["error_quant"]) <= SPEEDUP_BAR
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------- output
def short_table(report: dict) -> str:
    lines = [f"device {report['device']}   torch {report['versions']['torch']}   "
             f"torchao {report['versions']['torchao']}   commit {report['git']['commit']}   "
             f"wall {report['wall_s']} s {report.get('part_wall_s', {})}"]
    a = report.get("a")
    if a:
        lines.append("(a) kernel-only TFLOP/s, tool vs do_bench, interleaved; acceptance = same operands, bar ±5%")
        lines.append(f"    {'shape':<30}{'format':<16}{'tool':>8}{'raw':>8}{'as rep.':>9}"
                     f"{'same ops: tool':>16}{'raw':>7}   verdict   explanation")
        for r in a["rows"] + a["anchor_shapes"]:
            ok = "ok" if r["within_5pct"] else "OUTSIDE"
            lines.append(f"    {r['shape']:<30}{r['format']:<16}{r['tool_tflops']:8.4g}{r['raw_tflops']:8.4g}"
                         f"{r['ratio_as_reported']:9.3f}{r['acceptance_ratio']:16.3f}"
                         f"{r['acceptance_ratio_raw_operands']:7.3f}   {ok:<9} {r['explains']}")
    for part, title in (("b", "(b) 1.14B Llama, 4 x 2048"), ("c", "(c) CodonFM-5B, non-gated MLP, no GQA, 31 x 512")):
        res = report.get(part)
        if not res:
            continue
        step = res.get("bf16_step_time_s")
        lines.append(f"{title}: whole-step speedup vs BF16 (failed checks: {len(res['failures'])}); "
                     + (f"predictions from BF16 step {step:.4f} s" if step else "no BF16 step: GEMM-only bounds"))
        lines.append(f"    {'format':<16}{'kernel':>8}{'quant':>8}{'quant ms':>10}  {'backend':<10} "
                     f"predicted end-to-end: kernel-only (upper bound) / with quantization (expected)")
        for fmt in res["formats"]:
            if fmt == "bf16":
                continue
            cells = []
            for mode in ("kernel", "quant"):
                t = res["totals"].get(mode, {}).get(fmt)
                cells.append(f"{t['speedup']:.2f}x" if t and t["speedup"] else "-")
            q = res["totals"].get("quant", {}).get(fmt, {}).get("training", {}).get("quant_s")
            qms = f"{q * 1e3:.2f}" if q else "-"
            backends = sorted({str(r["backend"]) for r in res["results"] if r["format"] == fmt and r["backend"]})
            preds = []
            for mode in ("kernel", "quant"):
                p = res["prediction"].get(mode, {}).get(fmt)
                preds.append(f"{p['speedup']:.3f}x" if p and p.get("speedup") else "-")
            basis = next((p["basis"] for p in (res["prediction"].get(m, {}).get(fmt) for m in ("quant", "kernel")) if p), "-")
            lines.append(f"    {fmt:<16}{cells[0]:>8}{cells[1]:>8}{qms:>10}  {','.join(backends):<10} "
                         f"{preds[0]} / {preds[1]} ({basis})")
    c = report.get("c_vs_te")
    if c:
        lines.append("(c) vs Transformer Engine (published, H200; ours on this device), decoder-layer GEMMs")
        for row in c:
            ours = f"{row['ours']:.2f}x" if row["ours"] else "-"
            lines.append(f"    {row['format']:<16}{row['mode']:<8} ours {ours:>7}   TE {row['te_h200']:.2f}x")
    for row in report.get("b_vs_training", []):
        ok = ("" if "within_0.10" not in row else
              ("within ±0.10" if row["within_0.10"] else "OUTSIDE ±0.10"))
        pk = f"{row['predicted_kernel']:.3f}" if "predicted_kernel" in row else "-"
        pq = f"{row['predicted_quant']:.3f}" if "predicted_quant" in row else "-"
        lines.append(f"(b) vs training ({row['source']}): {row['recipe']}: measured {row['measured_speedup']:.3f}x, "
                     f"predicted with quantization {pq}x {ok}, kernel-only bound {pk}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=None, help="subset of a,b,c (default a,b,c; --quick: a,b)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed calls per GEMM in (b) and (c) (default: do_bench's time-based count)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds in (a) (default 5, --quick 3)")
    ap.add_argument("--bf16-step-time", type=float, default=None,
                    help="measured BF16 step (s) of the 1.14B config, batch 4 x 2048, on this device")
    ap.add_argument("--step-times", default="",
                    help="measured steps of that config: bf16=S,fp8_tensorwise=S,... (prediction + comparison)")
    ap.add_argument("--train-bench", type=Path, default=None,
                    help="a bench/train_bench.py JSON of this device: its 1b batch 4 x 2048 step times")
    ap.add_argument("--anchor-train", default="", help="e.g. bf16,fp8_tensorwise (slow: compiles models)")
    ap.add_argument("--quick", action="store_true",
                    help="about 2 minutes: (a) on 8192x4096x14336 only, (b) with BF16 and FP8 tensorwise only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU allowed: checks the script only")
    args = ap.parse_args(argv)
    parts_text = args.parts or ("a,b" if args.quick else "a,b,c")
    parts = {p.strip() for p in parts_text.split(",") if p.strip()}
    if not parts or not parts <= {"a", "b", "c"}:
        ap.error(f"--parts must be a subset of a,b,c, got {parts_text!r}")
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    rounds = args.rounds if args.rounds is not None else (3 if args.quick or args.smoke else 5)
    if rounds < 1:
        ap.error(f"--rounds must be >= 1, got {rounds}")
    if args.bf16_step_time is not None and not args.bf16_step_time > 0:
        ap.error(f"--bf16-step-time must be positive seconds, got {args.bf16_step_time}")
    try:
        step_times = parse_step_times(args.step_times)
        source = "--step-times"
        if args.train_bench is not None:
            if step_times:
                ap.error("give --step-times or --train-bench, not both")
            step_times, tb_device = step_times_from_train_bench(args.train_bench)
            source = f"{args.train_bench.name} ({tb_device})"
    except ValueError as exc:
        ap.error(str(exc))
    if args.bf16_step_time is not None:
        if step_times and abs(step_times["bf16"] - args.bf16_step_time) > 1e-12:
            ap.error("--bf16-step-time disagrees with the bf16 step of --step-times/--train-bench; give one")
        step_times = step_times or {"bf16": args.bf16_step_time}
        source = source if len(step_times) > 1 else "--bf16-step-time"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        ap.error("no CUDA GPU: this benchmark is for the H100 machine; use --smoke to check it on CPU")
    if args.smoke and device.type == "cpu":
        # A smoke run checks the script, not the CPU's speed. On a CPU without FP8 units, oneDNN's FP8 matmul (what
        # torch._scaled_mm takes while oneDNN is enabled) is its reference implementation: ~0.13 s for a 128 x 128 x
        # 256 product, where torch's own fallback (the same bits) takes ~0.4 ms. The flag is restored on return.
        with torch.backends.mkldnn.flags(enabled=False):
            return _run(args, parts, rounds, step_times, source, device)
    return _run(args, parts, rounds, step_times, source, device)


def _run(args, parts: set, rounds: int, step_times: dict, source: str, device: torch.device) -> int:
    """main's measurements, report and exit code, once its arguments are checked."""
    t_start = time.time()
    b_dims, c_dims = LLAMA_1B, CODONFM_5B
    b_batch, c_batch = (4, 2048), (31, 512)
    b_formats = ["bf16", "fp8_tensorwise"] if args.quick else list(FORMATS)
    if args.smoke:
        b_dims = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
        c_dims = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=128)
        b_batch, c_batch = (1, 128), (1, 128)
    if device.type == "cuda":
        # Tensor-core clocks ramp up under load: one second of BF16 GEMMs before anything is timed.
        x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        t_warm = time.time()
        while time.time() - t_warm < 1.0:
            for _ in range(10):
                x @ x
            torch.cuda.synchronize()
        del x

    report: dict = {"errors": {}, "part_wall_s": {}}

    def attempt(part: str, fn):
        # One part failing (a missing kernel, out of memory) must not cost the others their results.
        t0 = time.time()
        try:
            report[part] = fn()
        except Exception as exc:  # noqa: BLE001
            import traceback
            report["errors"][part] = f"{type(exc).__name__}: {exc}"
            log(f"part {part} failed:\n{traceback.format_exc()}")
        report["part_wall_s"][part] = round(time.time() - t0, 1)

    if "a" in parts:
        attempt("a", lambda: part_a(device, args.smoke, args.quick, rounds))
    if "b" in parts:
        log(f"(b) 1.14B Llama, {', '.join(b_formats)}, both modes")
        attempt("b", lambda: run_gemm_benchmark(
            b_dims, micro_batch=b_batch[0], seq_len=b_batch[1], formats=b_formats, modes=["kernel", "quant"],
            repeats=args.repeats, device=device, bf16_step_time_s=step_times.get("bf16"),
            progress=lambda m: log(f"  (b) {m}")))
        if "b" in report and len(step_times) > 1:
            report["b_vs_training"] = compare_with_training(report["b"], step_times, source)
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
        report["anchor_training"] = tr = run_anchor_training(recipes)
        anchor_steps = {r: v["step_s"] for r, v in tr.items() if isinstance(v, dict) and "step_s" in v}
        if "b" in report and "bf16" in anchor_steps and len(anchor_steps) > 1:
            # The reference model's steps, for the record; the prediction stays on --step-times if given.
            report["b_vs_anchor_training"] = compare_with_training(
                json.loads(json.dumps(report["b"])), anchor_steps, "hf_llama_anchor training, this call")

    any_res = next((report[p] for p in ("b", "c") if p in report), None) or run_gemm_benchmark(
        shapes="16x16x16", formats=["bf16"], modes=["kernel"], device=device, repeats=1, warmup=0)
    report.update(device=any_res["device"]["name"], versions=any_res["versions"], git=any_res["git"],
                  created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  wall_s=round(time.time() - t_start, 1), smoke=args.smoke, quick=args.quick)
    text = json.dumps(report, indent=1, default=str)
    slug = re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")
    kind = "smoke_" if args.smoke else ("quick_" if args.quick else "")
    name = f"gemm_bench_{kind}{slug}_{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M}.json"
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
