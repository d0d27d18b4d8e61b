"""`run_gemm_benchmark`: time every GEMM of a model's training step in every format and mode."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .formats import (ERROR_BOUNDS, FORMATS, MODES, UnsupportedShape, logical_operands, make_operands,
                      prepare, sm_version)
from .predict import aggregate, predict_speedup
from .shapes import GemmShape, gemm_shapes, model_dims, parse_shapes
from .timing import buffer_count, time_gemm

SCHEMA = "plab.gemm_bench/1"
DEFAULT_VOCAB = 32000  # the vocabulary of the 1.14B anchor (ANCHORS.md)


def resolve_model(model: Any, *, seq_len: int, vocab_size: int | None = None, no_gqa: bool = False) -> dict:
    """Model dims (dict) from a preset name, a dims dict or a LlamaConfig."""
    if isinstance(model, str):
        from training.model import PRESETS, llama_config
        if model not in PRESETS:
            raise ValueError(f"unknown model preset {model!r}; use one of {', '.join(PRESETS)} "
                             "or a dict of Llama dims")
        model = llama_config(model, vocab_size or DEFAULT_VOCAB, seq_len)
    elif isinstance(model, dict) and vocab_size is not None:
        model = {**model, "vocab_size": vocab_size}
    dims = model_dims(model)
    if vocab_size is not None:
        dims["vocab_size"] = vocab_size
    if no_gqa:
        dims["num_key_value_heads"] = dims["num_attention_heads"]
    return dims


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("torchao", "triton"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _git_commit() -> dict:
    # A copy of the working tree without .git (e.g. on a benchmark machine) names its commit in PLAB_GIT_COMMIT.
    if os.environ.get("PLAB_GIT_COMMIT"):
        return {"commit": os.environ["PLAB_GIT_COMMIT"], "gemm_code_dirty": None}
    repo = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "training/gemm"], cwd=repo,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "gemm_code_dirty": None}
    return {"commit": sha, "gemm_code_dirty": dirty}


def _device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "sm": sm_version(device),
                "memory_gib": round(props.total_memory / 2**30, 1), "timer": "cuda_events"}
    return {"type": "cpu", "name": platform.processor() or platform.machine() or "CPU",
            "threads": torch.get_num_threads(), "timer": "CPU"}


def _resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        dev = device
    elif device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif device in ("cpu", "cuda") or (isinstance(device, str) and device.startswith("cuda:")):
        dev = torch.device(device)
    else:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but no CUDA GPU is available; use --device cpu")
    return dev


def _validate_list(name: str, values: Iterable[str] | str | None, allowed: tuple, default: tuple) -> list:
    if values is None:
        return list(default)
    if isinstance(values, str):
        values = [v.strip() for v in values.split(",") if v.strip()]
    values = list(values)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"bad {name} {bad or values!r}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(values))


def relative_error(c: torch.Tensor, c_ref: torch.Tensor) -> float:
    """‖C − C_ref‖ / ‖C_ref‖ in FP32 (NaN/Inf in C give inf)."""
    c32, r32 = c.float(), c_ref.float()
    if not torch.isfinite(c32).all():
        return float("inf")
    return float((c32 - r32).norm() / r32.norm().clamp_min(1e-30))


def run_gemm_benchmark(model: Any = None, *, micro_batch: int = 4, seq_len: int = 2048,
                       shapes: str | list[GemmShape] | None = None, formats: Iterable[str] | str | None = None,
                       modes: Iterable[str] | str | None = None, gated_mlp: bool = True,
                       no_gqa: bool = False, vocab_size: int | None = None, repeats: int | None = None,
                       warmup: int | None = None, device: str | torch.device = "auto",
                       bf16_step_time_s: float | None = None, compile_quant: bool = True, seed: int = 0,
                       progress: Callable[[str], None] | None = None) -> dict:
    """Time each GEMM of one training step per format and mode; returns a JSON-able result dict.

    Give `model` (preset name `tiny|125m|350m|1b`, a dims dict or a LlamaConfig) with `micro_batch` and
    `seq_len`, or `shapes` ("MxKxN,..." or GemmShape list) for GEMMs timed as given. Every low-precision
    result is checked against the BF16 product of the same operands; failures are in `failures`.
    `bf16_step_time_s`, a measured BF16 training step of the same config on the same device, turns the
    GEMM-only speedup into an Amdahl prediction of the end-to-end speedup.
    """
    formats = _validate_list("formats", formats, FORMATS, FORMATS)
    if "bf16" not in formats:
        formats.insert(0, "bf16")  # every speedup and error check is relative to BF16
    modes = _validate_list("modes", modes, MODES, MODES)
    dev = _resolve_device(device)
    repeats = repeats if repeats is not None else (20 if dev.type == "cuda" else 3)
    warmup = warmup if warmup is not None else (5 if dev.type == "cuda" else 1)
    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if bf16_step_time_s is not None and (not isinstance(bf16_step_time_s, (int, float)) or bf16_step_time_s <= 0):
        raise ValueError(f"bf16_step_time_s must be positive seconds, got {bf16_step_time_s!r}")
    say = progress or (lambda msg: None)

    config: dict = {"micro_batch": micro_batch, "seq_len": seq_len, "gated_mlp": gated_mlp}
    if shapes is not None:
        if model is not None:
            raise ValueError("give either a model or explicit shapes, not both")
        shape_list = parse_shapes(shapes) if isinstance(shapes, str) else list(shapes)
        if not shape_list or not all(isinstance(s, GemmShape) for s in shape_list):
            raise ValueError("shapes must be 'MxKxN,...' or a non-empty list of GemmShape")
        config = {"shapes": "custom"}
    elif model is None:
        raise ValueError("give a model (preset name, dims dict or LlamaConfig) or shapes='MxKxN,...'")
    else:
        dims = resolve_model(model, seq_len=seq_len, vocab_size=vocab_size, no_gqa=no_gqa)
        shape_list = gemm_shapes(dims, micro_batch, seq_len, gated_mlp=gated_mlp)
        config.update(model=model if isinstance(model, str) else "custom", dims=dims,
                      tokens_per_micro_batch=micro_batch * seq_len)

    # The request re-runs this benchmark: run_gemm_benchmark(**result["request"]) (Celery tasks, the API).
    request = {"model": None if shapes is not None else (model if isinstance(model, str) else dims),
               "shapes": ",".join(f"{s.m}x{s.k}x{s.n}" for s in shape_list) if shapes is not None else None,
               "micro_batch": micro_batch, "seq_len": seq_len, "formats": formats, "modes": modes,
               "gated_mlp": gated_mlp, "no_gqa": no_gqa, "vocab_size": vocab_size, "repeats": repeats,
               "warmup": warmup, "device": str(device), "bf16_step_time_s": bf16_step_time_s,
               "compile_quant": compile_quant, "seed": seed}
    gen = torch.Generator(device=dev).manual_seed(seed)
    records: list[dict] = []
    for shape in shape_list:
        say(f"{shape.label} (x{shape.count})")
        set_bytes = 2 * (shape.m * shape.k + shape.k * shape.n)
        n_buf = buffer_count(set_bytes, dev)
        buffers = [make_operands(shape, dev, gen) for _ in range(n_buf)]
        ref = torch.mm(*logical_operands(shape.gemm, *buffers[0]))
        bf16_time = None
        for fmt in formats:
            for mode in (["both"] if fmt == "bf16" else modes):
                rec = {**shape.to_dict(), "flops": shape.flops, "format": fmt, "mode": mode,
                       "backend": None, "time_s": None, "tflops": None, "speedup_vs_bf16": None,
                       "rel_error": None, "error_bound": ERROR_BOUNDS.get(fmt), "check": None, "note": ""}
                try:
                    prepared = prepare(fmt, "kernel" if mode == "both" else mode, shape, buffers, dev,
                                       compile_quant=compile_quant)
                    rec["backend"], rec["note"] = prepared.backend, prepared.note
                    if fmt != "bf16":
                        err = relative_error(prepared.run(0), ref)
                        rec["rel_error"] = err
                        rec["check"] = "pass" if err <= ERROR_BOUNDS[fmt] else "fail"
                    timing = time_gemm(prepared.run, n_buf, dev, warmup=warmup, repeats=repeats)
                except UnsupportedShape as exc:
                    rec.update(check="unsupported", note=str(exc))
                except Exception as exc:  # a broken kernel must not hide the other results
                    rec.update(check="error", note=f"{type(exc).__name__}: {exc}")
                else:
                    rec.update(time_s=timing["median_s"], timing=timing,
                               tflops=shape.flops / timing["median_s"] / 1e12)
                    if fmt == "bf16":
                        bf16_time = timing["median_s"]
                    elif bf16_time:
                        rec["speedup_vs_bf16"] = bf16_time / timing["median_s"]
                finally:
                    prepared = None
                records.append(rec)
        del buffers, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    totals = aggregate(records, formats, modes)
    bf16_total = totals[modes[0]]["bf16"]["total_s"]
    prediction = {mode: {fmt: predict_speedup(bf16_total, t["total_s"], bf16_step_time_s)
                         for fmt, t in totals[mode].items() if fmt != "bf16" and bf16_total and t["total_s"]}
                  for mode in modes}
    failures = [f"{r['layer']}.{r['gemm']} {r['m']}x{r['k']}x{r['n']} {r['format']}/{r['mode']}: "
                + (f"relative error {r['rel_error']:.4g} > bound {r['error_bound']}" if r["check"] == "fail"
                   else r["note"])
                for r in records if r["check"] in ("fail", "error")]
    return {
        "schema": SCHEMA,
        "request": request,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": _device_info(dev),
        "versions": _versions(),
        "git": _git_commit(),
        "config": config,
        "formats": formats,
        "modes": modes,
        "repeats": repeats,
        "warmup": warmup,
        "bf16_step_time_s": bf16_step_time_s,
        "shapes": [s.to_dict() for s in shape_list],
        "results": records,
        "totals": totals,
        "prediction": prediction,
        "failures": failures,
    }
