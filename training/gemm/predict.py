"""From per-shape timings to per-layer and whole-step GEMM time, and a predicted end-to-end speedup.

Whole-step time of a format and mode = Σ count × time over all shapes, split into GEMM time G (kernel-only
timings) and, in quant mode, quantization time Q (the step's per-tensor quantization work, see
quantization.py). A shape the format cannot run (UnsupportedShape) or whose run failed is charged at its
BF16 time, because training keeps that layer in BF16; such shapes are listed so the reader sees it.

The prediction follows what training converts: `training.precision.apply_recipe` (like the reference
tool's `convert_to_float8_training(model.model)`) converts the decoder blocks' linear layers and keeps the
LM head in BF16. So the "training" figures charge the layers of BF16_LAYERS at their BF16 GEMM time with
no quantization, whatever the format; `total_s` and the per-layer figures still show every layer in the
format.

Amdahl, with a measured BF16 step time S of the same config on the same device and G_bf16 the BF16 GEMM
time of the step:

    predicted step    = (S − G_bf16) + G_fmt + Q_fmt
    predicted speedup = S / predicted step

Both modes are reported: kernel-only (Q = 0) is an upper bound - it assumes quantization is free -, with
quantization (Q from the per-tensor timings) is the expected speedup. Without S the figure is the
GEMM-only speedup G_bf16 / (G_fmt + Q_fmt), itself an upper bound on the end-to-end speedup.
"""
from __future__ import annotations

from collections import defaultdict

BF16_LAYERS = ("lm_head",)
PREDICTION_LABELS = {
    "kernel": "kernel-only: upper bound (quantization assumed free)",
    "quant": "with quantization: expected (GEMMs + the step's quantization work)",
}


def aggregate(records: list[dict], formats: list[str], modes: list[str],
              bf16_layers: tuple = BF16_LAYERS) -> dict:
    """`{mode: {format: {"per_layer_s", "per_layer_speedup", "gemm_s", "quant_s", "total_s", "speedup",
    "bf16_fallback", "training"}}}`; `training` holds the figures the prediction uses (layers of
    `bf16_layers` at BF16)."""
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
            gemm_s = quant_s = train_gemm = train_quant = 0.0
            kept = set()
            for k, ref in bf16.items():
                rec = timed.get((fmt, "*" if fmt == "bf16" else mode, k))
                if rec and rec.get("time_s"):
                    g = rec.get("gemm_s", rec["time_s"])
                    q = rec.get("quant_s") or 0.0
                else:
                    fallback.append(f"{k[0]}.{k[1]} {k[2]}x{k[3]}x{k[4]}")
                    g, q = ref["time_s"], 0.0
                c = ref["count"]
                per_layer[ref["layer"]] += c * (g + q)
                per_layer_bf16[ref["layer"]] += c * ref["time_s"]
                gemm_s += c * g
                quant_s += c * q
                if fmt != "bf16" and ref["layer"] in bf16_layers:
                    kept.add(ref["layer"])
                    train_gemm += c * ref["time_s"]
                else:
                    train_gemm += c * g
                    train_quant += c * q
            total = gemm_s + quant_s
            total_bf16 = sum(per_layer_bf16.values())
            train_total = train_gemm + train_quant
            out[mode][fmt] = {
                "per_layer_s": dict(per_layer),
                "per_layer_speedup": {layer: per_layer_bf16[layer] / t for layer, t in per_layer.items() if t},
                "gemm_s": gemm_s,
                "quant_s": quant_s,
                "total_s": total,
                "speedup": total_bf16 / total if total else None,
                "bf16_fallback": fallback,
                "training": {"gemm_s": train_gemm, "quant_s": train_quant, "total_s": train_total,
                             "speedup": total_bf16 / train_total if train_total else None,
                             "bf16_layers": sorted(kept)},
            }
    return out


def predict_speedup(bf16_gemm_s: float, fmt_gemm_s: float, bf16_step_s: float | None = None, *,
                    quant_s: float = 0.0) -> dict:
    """Amdahl prediction for one format; `basis` says whether a measured step time was used.

    predicted step = (bf16_step_s − bf16_gemm_s) + fmt_gemm_s + quant_s."""
    if bf16_gemm_s <= 0 or fmt_gemm_s <= 0:
        raise ValueError(f"GEMM times must be positive, got bf16={bf16_gemm_s}, format={fmt_gemm_s}")
    if quant_s < 0:
        raise ValueError(f"quantization time must be >= 0, got {quant_s}")
    fmt_s = fmt_gemm_s + quant_s
    gemm_speedup = bf16_gemm_s / fmt_s
    parts = {"bf16_gemm_s": bf16_gemm_s, "gemm_s": fmt_gemm_s, "quant_s": quant_s}
    if bf16_step_s is None:
        return {"basis": "GEMM-only", "speedup": gemm_speedup, "gemm_speedup": gemm_speedup,
                "gemm_share": None, **parts,
                "note": "no measured BF16 step time: GEMM-only speedup, an upper bound"}
    if bf16_step_s <= 0:
        raise ValueError(f"bf16 step time must be positive seconds, got {bf16_step_s}")
    share = bf16_gemm_s / bf16_step_s
    if share > 1:
        # The isolated GEMMs take longer than the whole measured step: the step time belongs to another
        # config/device, or it was measured with overlapping work; refuse a meaningless prediction.
        return {"basis": "invalid", "speedup": None, "gemm_speedup": gemm_speedup, "gemm_share": share,
                **parts, "note": f"BF16 GEMM time {bf16_gemm_s:.4g}s exceeds the measured step "
                                 f"{bf16_step_s:.4g}s; check that the step time is for this model, "
                                 "micro-batch and device"}
    predicted_step = bf16_step_s - bf16_gemm_s + fmt_s
    return {"basis": "amdahl", "speedup": bf16_step_s / predicted_step, "gemm_speedup": gemm_speedup,
            "gemm_share": share, "predicted_step_s": predicted_step, "bf16_step_s": bf16_step_s, **parts,
            "note": ""}


def predictions(totals: dict, bf16_step_s: float | None) -> dict:
    """`{mode: {format: prediction}}` from `aggregate`'s totals, each labelled with what it means."""
    out: dict = {}
    for mode, per_fmt in totals.items():
        bf16_total = per_fmt.get("bf16", {}).get("total_s")
        out[mode] = {}
        if not bf16_total:
            continue
        for fmt, t in per_fmt.items():
            train = t["training"]
            if fmt == "bf16" or not train["gemm_s"]:
                continue
            pred = predict_speedup(bf16_total, train["gemm_s"], bf16_step_s,
                                   quant_s=train["quant_s"] if mode == "quant" else 0.0)
            pred["label"] = PREDICTION_LABELS.get(mode, mode)
            pred["bf16_layers"] = train["bf16_layers"]
            out[mode][fmt] = pred
    return out
