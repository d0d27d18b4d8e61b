"""From per-shape timings to per-layer and whole-step GEMM time, and a predicted end-to-end speedup.

Whole-step GEMM time of a format = Σ count × time over all shapes. A shape the format cannot run
(UnsupportedShape) or whose run failed is charged at its BF16 time, because training keeps that layer in
BF16; such shapes are listed so the reader sees the prediction is partial.

Amdahl: with a measured BF16 step time S and BF16 GEMM time G_bf16, only the GEMM part changes:
predicted step = S − G_bf16 + G_fmt, predicted speedup = S / predicted step. Without S the figure is the
GEMM-only speedup G_bf16 / G_fmt (an upper bound on the end-to-end speedup).
"""
from __future__ import annotations

from collections import defaultdict


def aggregate(records: list[dict], formats: list[str], modes: list[str]) -> dict:
    """`{mode: {format: {"per_layer_s", "per_layer_speedup", "total_s", "speedup", "bf16_fallback"}}}`."""
    def key(r):
        return r["layer"], r["gemm"], r["m"], r["k"], r["n"]

    bf16 = {key(r): r for r in records if r["format"] == "bf16" and r.get("time_s")}
    # BF16 has one timing for both modes (nothing to quantize).
    timed = {(r["format"], "*" if r["format"] == "bf16" else r["mode"], key(r)): r for r in records}
    out: dict = {}
    for mode in modes:
        out[mode] = {}
        for fmt in formats:
            per_layer: dict = defaultdict(float)
            per_layer_bf16: dict = defaultdict(float)
            fallback = []
            for k, ref in bf16.items():
                rec = timed.get((fmt, "*" if fmt == "bf16" else mode, k))
                t = rec.get("time_s") if rec else None
                if not t:
                    fallback.append(f"{k[0]}.{k[1]} {k[2]}x{k[3]}x{k[4]}")
                    t = ref["time_s"]
                per_layer[ref["layer"]] += ref["count"] * t
                per_layer_bf16[ref["layer"]] += ref["count"] * ref["time_s"]
            total = sum(per_layer.values())
            total_bf16 = sum(per_layer_bf16.values())
            out[mode][fmt] = {
                "per_layer_s": dict(per_layer),
                "per_layer_speedup": {layer: per_layer_bf16[layer] / t for layer, t in per_layer.items() if t},
                "total_s": total,
                "speedup": total_bf16 / total if total else None,
                "bf16_fallback": fallback,
            }
    return out


def predict_speedup(bf16_gemm_s: float, fmt_gemm_s: float, bf16_step_s: float | None = None) -> dict:
    """Amdahl prediction for one format; `basis` says whether a measured step time was used."""
    if bf16_gemm_s <= 0 or fmt_gemm_s <= 0:
        raise ValueError(f"GEMM times must be positive, got bf16={bf16_gemm_s}, format={fmt_gemm_s}")
    gemm_speedup = bf16_gemm_s / fmt_gemm_s
    if bf16_step_s is None:
        return {"basis": "GEMM-only", "speedup": gemm_speedup, "gemm_speedup": gemm_speedup,
                "gemm_share": None, "note": "no measured BF16 step time: GEMM-only speedup, an upper bound"}
    if bf16_step_s <= 0:
        raise ValueError(f"bf16 step time must be positive seconds, got {bf16_step_s}")
    share = bf16_gemm_s / bf16_step_s
    note = ""
    if share > 1:
        # The isolated GEMMs take longer than the whole measured step: the step time belongs to another
        # config/device, or it was measured with overlapping work; refuse a meaningless prediction.
        return {"basis": "invalid", "speedup": None, "gemm_speedup": gemm_speedup, "gemm_share": share,
                "note": f"BF16 GEMM time {bf16_gemm_s:.4g}s exceeds the measured step {bf16_step_s:.4g}s; "
                        "check that the step time is for this model, micro-batch and device"}
    predicted_step = bf16_step_s - bf16_gemm_s + fmt_gemm_s
    return {"basis": "amdahl", "speedup": bf16_step_s / predicted_step, "gemm_speedup": gemm_speedup,
            "gemm_share": share, "predicted_step_s": predicted_step, "bf16_step_s": bf16_step_s,
            "note": note}
