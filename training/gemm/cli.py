"""`plab gemm-bench`: argument parsing, the run, a printed table, a JSON file and the result callback."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from .benchmark import run_gemm_benchmark
from .formats import FORMATS, MODES
from .shapes import parse_shapes

PRESET_NAMES = ("tiny", "125m", "350m", "1b")


def _model_arg(text: str):
    if text in PRESET_NAMES:
        return text
    if text.lstrip().startswith("{"):
        try:
            dims = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--model JSON does not parse ({exc.msg} at char {exc.pos})")
        if not isinstance(dims, dict):
            raise argparse.ArgumentTypeError("--model JSON must be an object of Llama dims")
        return dims
    if text.endswith(".json") or Path(text).is_dir():  # a config.json of any transformers causal LM
        return Path(text)
    raise argparse.ArgumentTypeError(
        f"--model must be one of {', '.join(PRESET_NAMES)}, a config.json (or its folder) or a JSON object such as "
        '\'{"hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 24, '
        '"num_attention_heads": 32, "vocab_size": 128}\', got ' + repr(text))


def _csv_choice(allowed: tuple, what: str):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad or text!r}; choose from {', '.join(allowed)}")
        return items
    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive seconds, got {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected positive seconds, got {value}")
    return value


def _shapes_arg(text: str):
    try:
        return parse_shapes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plab gemm-bench",
        description="Time the GEMMs (fprop, dgrad, wgrad) of a Llama training step per number format, "
                    "kernel-only and with quantization, check each against BF16 and predict the speedup.")
    p.add_argument("--model", type=_model_arg, help=f"{' | '.join(PRESET_NAMES)} | JSON dims object")
    p.add_argument("--shapes", type=_shapes_arg, help="explicit GEMMs MxKxN,... instead of a model")
    p.add_argument("--micro-batch", type=_positive_int, default=4)
    p.add_argument("--seq-len", type=_positive_int, default=2048)
    p.add_argument("--vocab-size", type=_positive_int, default=None,
                   help="lm_head width (default: the preset's or 32000)")
    p.add_argument("--formats", type=_csv_choice(FORMATS, "format"), default=list(FORMATS),
                   help=f"comma-separated subset of {','.join(FORMATS)}")
    p.add_argument("--mode", choices=("kernel", "quant", "both"), default="both",
                   help="kernel: operands quantized beforehand; quant: plus the step's quantization of "
                        "X, W, dY per layer (each tensor timed once, counted per occurrence)")
    p.add_argument("--non-gated-mlp", action="store_true",
                   help="plain MLP: up-projection width = intermediate (default: SwiGLU gate+up = 2x)")
    p.add_argument("--no-gqa", action="store_true", help="num_key_value_heads = num_attention_heads")
    p.add_argument("--repeats", type=_positive_int, default=None,
                   help="timed calls per GEMM (median); default on CUDA: do_bench's count (100 ms of calls), CPU 3")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls first; default on CUDA: do_bench's count (25 ms of calls), CPU 1")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--bf16-step-time", type=_positive_float, default=None,
                   help="measured BF16 training step (s) of this config on this device for the Amdahl prediction: "
                        "the step of one micro-batch of --micro-batch sequences, as the GEMMs timed are one "
                        "micro-batch's (a run with gradient accumulation: its step time / its accumulation steps)")
    p.add_argument("--no-compile-quant", action="store_true",
                   help="run the quantizers of quant mode eagerly (default on CUDA: torch.compile where training "
                        "compiles them)")
    p.add_argument("--output", type=Path, default=None, help="write the result JSON here")
    return p


def format_table(result: dict) -> str:
    """Per-shape speedups, the step's quantization per tensor and per-format totals as plain text."""
    lines = []
    dev = result["device"]
    lines.append(f"device: {dev['name']} ({dev['type']}, timer {dev['timer']}); {result.get('protocol', '')}")
    lines.append(f"{'gemm':<32}{'format':<16}{'mode':<8}{'backend':<10}{'ms':>9}{'quant ms':>9}{'TFLOP/s':>10}"
                 f"{'vs bf16':>9}{'rel.err':>9}  check")
    for r in result["results"]:
        name = f"{r['layer']}.{r['gemm']} {r['m']}x{r['k']}x{r['n']}"
        ms = f"{r['time_s'] * 1e3:.3f}" if r["time_s"] else "-"
        qms = f"{r['quant_s'] * 1e3:.3f}" if r.get("quant_s") else "-"
        tf = f"{r['tflops']:.4g}" if r["tflops"] else "-"
        sp = f"{r['speedup_vs_bf16']:.2f}x" if r["speedup_vs_bf16"] else "-"
        er = f"{r['rel_error']:.3g}" if r["rel_error"] is not None else "-"
        lines.append(f"{name:<32}{r['format']:<16}{r['mode']:<8}{str(r['backend']):<10}{ms:>9}{qms:>9}{tf:>10}"
                     f"{sp:>9}{er:>9}  {r['check'] or ''}")
    tensors = result.get("quantization", {}).get("tensors", [])
    if tensors:
        lines.append("")
        lines.append("quantization per step tensor (timed once per distinct shape, counted per occurrence):")
        lines.append(f"  {'format':<16}{'tensor':<18}{'rows x cols':>16}  {'layouts':<8}{'count':>6}{'ms':>9}"
                     f"{'in GB/s':>9}{'ms/step':>10}")
        for t in tensors:
            ms = f"{t['time_s'] * 1e3:.3f}" if t["time_s"] else "-"
            gbs = f"{2 * t['rows'] * t['cols'] / t['time_s'] / 1e9:.3g}" if t["time_s"] else "-"
            step = f"{t['per_step_s'] * 1e3:.3f}" if t.get("per_step_s") else (t.get("error") or "-")
            lines.append(f"  {t['format']:<16}{t['tensor']:<18}{t['rows']:>8}x{t['cols']:<7}  "
                         f"{'+'.join(t['layouts']):<8}{t['count']:>6}{ms:>9}{gbs:>9}{step:>10}")
    lines.append("")
    lines.append("whole step (sum of count x time; GEMM + quantization):")
    for mode, per_fmt in result["totals"].items():
        for fmt, t in per_fmt.items():
            pred = result["prediction"].get(mode, {}).get(fmt)
            extra = ""
            if pred:
                extra = (f"  predicted {pred['speedup']:.3f}x ({pred['basis']}; {pred.get('label', mode)})"
                         if pred["speedup"] else f"  prediction {pred['basis']}: {pred['note']}")
            fb = f"  [{len(t['bf16_fallback'])} shapes at BF16]" if fmt != "bf16" and t["bf16_fallback"] else ""
            sp = f"{t['speedup']:.2f}x" if t["speedup"] else "-"
            split = f" (GEMM {t['gemm_s'] * 1e3:.3f} + quant {t['quant_s'] * 1e3:.3f})" if t.get("quant_s") else ""
            lines.append(f"  {mode:<7}{fmt:<16}{t['total_s'] * 1e3:10.3f} ms{split}  GEMM speedup {sp}{extra}{fb}")
    kept = result.get("bf16_layers")
    if kept and any(p.get("bf16_layers") for per in result["prediction"].values() for p in per.values()):
        lines.append(f"  predictions keep {', '.join(kept)} in BF16, as training does")
    if result["failures"]:
        lines.append("")
        lines.append(f"FAILED CHECKS ({len(result['failures'])}):")
        lines += [f"  {f}" for f in result["failures"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, post_result: Callable[[dict], None] | None = None) -> int:
    """Run `plab gemm-bench`; returns 0, or 1 when a low-precision result failed its check vs BF16."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.model is None) == (args.shapes is None):
        parser.error("give exactly one of --model (preset or JSON dims) or --shapes MxKxN,...")
    if args.shapes is not None and (args.non_gated_mlp or args.no_gqa or args.vocab_size):
        parser.error("--non-gated-mlp, --no-gqa and --vocab-size describe a model; they do not apply to --shapes")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    modes = list(MODES) if args.mode == "both" else [args.mode]
    if args.output is not None:  # before minutes of GPU timing, not after
        from training.outputs import output_problem

        problem = output_problem(args.output, folder=False)
        if problem:
            parser.error(f"--output {args.output}: {problem}")
    try:
        result = run_gemm_benchmark(
            args.model, shapes=args.shapes, micro_batch=args.micro_batch, seq_len=args.seq_len,
            formats=args.formats, modes=modes, gated_mlp=not args.non_gated_mlp, no_gqa=args.no_gqa,
            vocab_size=args.vocab_size, repeats=args.repeats, warmup=args.warmup, device=args.device,
            bf16_step_time_s=args.bf16_step_time, compile_quant=not args.no_compile_quant,
            progress=lambda msg: print(f"  timing {msg}", file=sys.stderr, flush=True))
    except ValueError as exc:
        parser.error(str(exc))
    print(format_table(result))
    if args.output is not None:
        text = json.dumps(result, indent=1)
        try:
            args.output.write_text(text)
            print(f"\nresult written to {args.output}")
        except OSError as err:  # the table is printed; the result goes to a file that can be written
            import tempfile

            fd, fallback = tempfile.mkstemp(prefix="plab-gemm-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            print(f"plab gemm-bench: could not write {args.output} ({err}); the result is in {fallback}",
                  file=sys.stderr)
    if post_result is not None:
        post_result(result)
    return 1 if result["failures"] else 0
