"""`run_gemm_benchmark`: time every GEMM of a model's training step in every format and mode.

Formats are the catalog's (`training.precision.catalog.gemm_formats()`); each format's quantizers and GEMMs come
from its recipe (`GemmOps`, training/precision/gemm_ops.py), so nothing here knows a format beyond BF16, the
baseline every speedup and error check is relative to.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from training.precision.catalog import BASELINE
from training.devices import cpu_name

from .formats import (ERROR_BOUNDS, FORMATS, MODES, GemmOps, UnsupportedShape, format_ops, logical_operands,
                      make_operands, prepare, sm_version)
from .predict import BF16_LAYERS, aggregate, predictions
from .quantization import attributed_quant_s, readers, step_tensors, timing_key
from .shapes import GemmShape, gemm_shapes, model_dims, parse_shapes
from .timing import PROTOCOL, buffer_count, time_gemm

SCHEMA = "plab.gemm_bench/1"
DEFAULT_VOCAB = 32000  # the vocabulary of the 1.14B reference anchor (bench/train_bench.py)


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
    return {"type": "cpu", "name": cpu_name(),
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


def _check_counts(repeats, warmup, bf16_step_time_s, compile_quant) -> None:
    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{name} must be an integer >= {low} (or None for do_bench's time-based count), "
                             f"got {value!r}")
    if bf16_step_time_s is not None and (isinstance(bf16_step_time_s, bool)
                                         or not isinstance(bf16_step_time_s, (int, float)) or bf16_step_time_s <= 0):
        raise ValueError(f"bf16_step_time_s must be positive seconds, got {bf16_step_time_s!r}")
    if not isinstance(compile_quant, bool):
        raise ValueError(f"compile_quant must be True or False, got {compile_quant!r}")


def relative_error(c: torch.Tensor, c_ref: torch.Tensor) -> float:
    """‖C − C_ref‖ / ‖C_ref‖ in FP32 (NaN/Inf in C give inf)."""
    c32, r32 = c.float(), c_ref.float()
    if not torch.isfinite(c32).all():
        return float("inf")
    return float((c32 - r32).norm() / r32.norm().clamp_min(1e-30))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Quantizers:
    """A format's training quantizers, compiled where training compiles them (on CUDA, `GemmOps.compiles`); if
    torch.compile fails they fall back to eager and the note says so."""

    def __init__(self, ops: GemmOps, compile_quant: bool):
        self.ops = ops
        self.compiled = compile_quant and ops.device.type == "cuda" and ops.compiles
        self.note = ops.quantizer_note(self.compiled)
        self._fns: dict = {}

    def __call__(self, role: str, x: torch.Tensor, layouts: tuple):
        if role not in self._fns:
            self._fns[role] = self.ops.quantizer(role, compiled=self.compiled)
        try:
            return self._fns[role](x, layouts)
        except Exception as exc:  # noqa: BLE001 - time the eager path rather than lose the format
            if not self.compiled:
                raise
            self.compiled = False
            self._fns.clear()
            self.note = f"eager quantizers (torch.compile failed: {type(exc).__name__}: {exc})"[:300]
            return self(role, x, layouts)


def _time_tensor_quantization(quant: _Quantizers, tensor, device, generator, warmup, repeats) -> dict:
    """Seconds to quantize one instance of `tensor` in all its layouts (first call = compile, untimed)."""
    n_buf = buffer_count(2 * tensor.elements, device)
    bufs = [torch.randn(tensor.rows, tensor.cols, device=device, dtype=torch.bfloat16, generator=generator)
            for _ in range(n_buf)]
    t0 = time.perf_counter()
    quant(tensor.role, bufs[0], tensor.layouts)
    _sync(device)
    first_call_s = time.perf_counter() - t0
    timing = time_gemm(lambda i: quant(tensor.role, bufs[i], tensor.layouts), n_buf, device,
                       warmup=warmup, repeats=repeats)
    return {"time_s": timing["median_s"], "timing": timing, "first_call_s": first_call_s,
            "bytes_read": 2 * tensor.elements}


def _shape_plan(model, shapes, *, micro_batch, seq_len, gated_mlp, no_gqa, vocab_size):
    """(shape list, config, the request's model or dims, the request's shapes string)."""
    config: dict = {"micro_batch": micro_batch, "seq_len": seq_len, "gated_mlp": gated_mlp}
    if shapes is not None:
        if model is not None:
            raise ValueError("give either a model or explicit shapes, not both")
        shape_list = parse_shapes(shapes) if isinstance(shapes, str) else list(shapes)
        if not shape_list or not all(isinstance(s, GemmShape) for s in shape_list):
            raise ValueError("shapes must be 'MxKxN,...' or a non-empty list of GemmShape")
        return shape_list, {"shapes": "custom"}, None, ",".join(f"{s.m}x{s.k}x{s.n}" for s in shape_list)
    if model is None:
        raise ValueError("give a model (preset name, dims dict or LlamaConfig) or shapes='MxKxN,...'")
    if isinstance(model, Path) or (isinstance(model, str) and model.endswith(".json")):
        model = _config_file(model)
    if getattr(model, "model_type", "llama") != "llama":  # any other architecture: the GEMMs of its modules
        shape_list = gemm_shapes(model, micro_batch, seq_len)
        config.update(model=model.model_type, tokens_per_micro_batch=micro_batch * seq_len)
        return shape_list, config, model.model_type, None
    dims = resolve_model(model, seq_len=seq_len, vocab_size=vocab_size, no_gqa=no_gqa)
    shape_list = gemm_shapes(dims, micro_batch, seq_len, gated_mlp=gated_mlp)
    config.update(model=model if isinstance(model, str) else "custom", dims=dims,
                  tokens_per_micro_batch=micro_batch * seq_len)
    return shape_list, config, model if isinstance(model, str) else dims, None


def _config_file(path):
    """The transformers config in a config.json (or a folder holding one), for the GEMMs of any architecture."""
    from transformers import AutoConfig
    path = Path(path)
    if not (path / "config.json" if path.is_dir() else path).is_file():
        raise ValueError(f"model {str(path)!r}: no config.json there; give a preset, a dims dict or a config.json")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def _empty_record(shape, fmt: str) -> dict:
    return {**shape.to_dict(), "flops": shape.flops, "format": fmt, "mode": "both" if fmt == BASELINE else "kernel",
            "backend": None, "time_s": None, "gemm_s": None, "quant_s": None, "tflops": None,
            "speedup_vs_bf16": None, "rel_error": None, "error_bound": ERROR_BOUNDS.get(fmt), "check": None,
            "note": ""}


def _check(rec: dict, fmt: str, c: torch.Tensor, ref: torch.Tensor) -> None:
    err = relative_error(c, ref)
    rec.update(rel_error=err, check="pass" if err <= ERROR_BOUNDS[fmt] else "fail")


@dataclass
class _Bench:
    """One benchmark run's settings and per-format state (`ops`: GemmOps, or the exception saying why the format
    has no kernels on this device; `plans`: the step's quantized tensors per format)."""

    dev: torch.device
    gen: torch.Generator
    warmup: int | None
    repeats: int | None
    modes: list
    ops: dict
    quantizers: dict
    plans: dict = field(default_factory=dict)
    pending: dict = field(default_factory=dict)  # (shape index, format) -> quant record awaiting its tensors' times
    say: Callable[[str], None] = lambda msg: None

    def supported(self, fmt: str) -> Callable:
        def check(shape) -> bool:
            if isinstance(self.ops[fmt], Exception):
                return False
            try:
                self.ops[fmt].check_shape(shape)
            except UnsupportedShape:
                return False
            return True
        return check

    def shape_records(self, si: int, shape, formats: list) -> list[dict]:
        """The records of one GEMM shape: BF16, then each format's kernel-only and quant-mode records."""
        self.say(f"{shape.label} (x{shape.count})")
        n_buf = buffer_count(2 * (shape.m * shape.k + shape.k * shape.n), self.dev)
        buffers = [make_operands(shape, self.dev, self.gen) for _ in range(n_buf)]
        ref = torch.mm(*logical_operands(shape.gemm, *buffers[0]))
        records, bf16_time = [], None
        for fmt in formats:
            rec = self._kernel_record(fmt, shape, buffers, ref, bf16_time)
            if fmt == BASELINE:
                bf16_time = rec["time_s"]
            if fmt == BASELINE or "kernel" in self.modes:
                records.append(rec)
            if fmt != BASELINE and "quant" in self.modes:
                qrec = self._quant_record(rec, fmt, si, shape, buffers, ref)
                records.append(qrec)
                if qrec["check"] in ("pass", "fail"):
                    self.pending[(si, fmt)] = qrec
        del buffers, ref
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        return records

    def _kernel_record(self, fmt: str, shape, buffers, ref, bf16_time) -> dict:
        rec = _empty_record(shape, fmt)
        try:
            if isinstance(self.ops.get(fmt), Exception):
                raise self.ops[fmt]
            prepared = prepare(fmt, shape, buffers, self.dev)
            rec["backend"], rec["note"] = prepared.backend, prepared.note
            if fmt != BASELINE:
                _check(rec, fmt, prepared.run(0), ref)
            timing = time_gemm(prepared.run, len(buffers), self.dev, warmup=self.warmup, repeats=self.repeats)
        except UnsupportedShape as exc:
            rec.update(check="unsupported", note=str(exc))
        except Exception as exc:  # a broken kernel must not hide the other results
            rec.update(check="error", note=f"{type(exc).__name__}: {exc}")
        else:
            rec.update(time_s=timing["median_s"], gemm_s=timing["median_s"], quant_s=0.0, timing=timing,
                       tflops=shape.flops / timing["median_s"] / 1e12)
            if fmt != BASELINE and bf16_time:
                rec["speedup_vs_bf16"] = bf16_time / timing["median_s"]
        return rec

    def _quant_record(self, krec: dict, fmt: str, si: int, shape, buffers, ref) -> dict:
        """The quant-mode record of one GEMM: its GEMM time now (the kernel-only one, or training's GEMM on the
        training quantizers' operands where that differs), its quantization share later; checked here with
        the operands the step's (timed) quantizers produce."""
        qrec = {k: v for k, v in krec.items() if k != "timing"}
        qrec.update(mode="quant", time_s=None, quant_s=None, tflops=None, speedup_vs_bf16=None, rel_error=None,
                    check=None)
        if krec.get("timing"):
            qrec["timing"] = krec["timing"]
        if krec["check"] == "unsupported":
            qrec["check"] = "unsupported"
            return qrec
        if krec["check"] == "error" or krec["time_s"] is None:
            qrec.update(check="error", note=f"kernel failed: {krec['note']}")
            return qrec
        ops, quant = self.ops[fmt], self.quantizers[fmt]
        tensors, uses = self.plans[fmt]
        try:
            # Every operand set where training's GEMM is timed here, else the first (for the check).
            operands = [[quant(tensors[t].role, stored, tensors[t].layouts)[tensors[t].layouts.index(layout)]
                         for (t, layout), stored in zip(uses[si], pair)]
                        for pair in (buffers if ops.separate_quant_gemm else buffers[:1])]
            gemm = ops.quant_gemm(shape.gemm)
            _check(qrec, fmt, gemm(*operands[0]), ref)
            if ops.separate_quant_gemm:
                timing = time_gemm(lambda i: gemm(*operands[i]), len(buffers), self.dev, warmup=self.warmup,
                                   repeats=self.repeats)
                qrec.update(gemm_s=timing["median_s"], timing=timing)
        except Exception as exc:  # noqa: BLE001
            qrec.update(check="error", note=f"quantization for the check failed: {type(exc).__name__}: {exc}"[:300])
            return qrec
        qrec["note"] = "; ".join(x for x in (krec["note"], f"quantization: {quant.note}") if x)
        return qrec

    def quantization_rows(self, fmt: str, records: list) -> list[dict]:
        """Time each distinct tensor the step quantizes in `fmt`; complete the format's quant-mode records."""
        tensors, uses = self.plans[fmt]
        if fmt not in self.quantizers or not tensors:
            return []
        quant = self.quantizers[fmt]
        rows, times, by_key = [], {}, {}
        for ti, tensor in enumerate(tensors):
            key = timing_key(quant.ops, tensor)
            row = {**tensor.to_dict(), "format": fmt, "time_s": None, "shared_with": None}
            if key in by_key:
                row["shared_with"] = by_key[key]["tensor"]
                row.update({k: by_key[key][k] for k in ("time_s", "note", "backend")})
            else:
                self.say(f"quantization {fmt} {tensor.name} {tensor.rows}x{tensor.cols} {'+'.join(tensor.layouts)}")
                try:
                    row.update(_time_tensor_quantization(quant, tensor, self.dev, self.gen, self.warmup,
                                                         self.repeats))
                except Exception as exc:  # noqa: BLE001 - reported, the GEMMs reading it say so
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                row.update(note=quant.note, backend=quant.ops.backend)
                by_key[key] = row
            if row["time_s"] is not None:
                times[ti] = row["time_s"]
                row["per_step_s"] = row["time_s"] * tensor.count
            rows.append(row)
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
        self._complete_quant_records(fmt, uses, tensors, times, records)
        return rows

    def _complete_quant_records(self, fmt: str, uses, tensors, times: dict, records: list) -> None:
        n_readers = readers(uses)
        bf16: dict = {}
        for r in records:
            if r["format"] == BASELINE and r["time_s"]:
                bf16.setdefault((r["layer"], r["gemm"], r["m"], r["k"], r["n"]), r["time_s"])
        for si, pair in enumerate(uses):
            qrec = self.pending.get((si, fmt))
            if qrec is None or pair is None:
                continue
            q = attributed_quant_s(pair, times, n_readers)
            if q is None:
                names = [tensors[t].name for t, _ in pair if t not in times]
                qrec.update(check="error", note=f"quantization of {', '.join(names)} failed (see quantization)")
                continue
            t = qrec["gemm_s"] + q
            bf16_t = bf16.get((qrec["layer"], qrec["gemm"], qrec["m"], qrec["k"], qrec["n"]))
            qrec.update(time_s=t, quant_s=q, tflops=qrec["flops"] / t / 1e12,
                        speedup_vs_bf16=bf16_t / t if bf16_t else None)


def _format_ops(low: list, dev: torch.device) -> dict:
    ops: dict = {}
    for fmt in low:
        try:
            ops[fmt] = format_ops(fmt, dev)
        except UnsupportedShape as exc:  # no kernels for the format on this GPU at all
            ops[fmt] = exc
    return ops


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

    Modes: `kernel` times each GEMM on operands quantized beforehand. `quant` adds the step's
    quantization work: each tensor the step quantizes (X, W, dY per layer, in the layouts its GEMMs read;
    quantization.py) is timed once per distinct shape, with the recipe's training quantizer, and counted with
    its multiplicity; a quant-mode GEMM record is the GEMM training runs on those operands plus its share of
    its tensors' quantization, and is checked with the operands those quantizers produce. `repeats`/`warmup`
    None: do_bench's time-based counts on CUDA (timing.py), 3/1 on CPU. `bf16_step_time_s`, a measured BF16
    training step of the same config on the same device for one micro-batch of `micro_batch` sequences (the
    GEMMs timed are one micro-batch's: with gradient accumulation, the step time / the accumulation steps; the
    dashboard scales the GEMMs by the accumulation instead), turns the GEMM-only speedup into an Amdahl
    prediction of the end-to-end speedup (predict.py), per mode: kernel-only = upper bound, with
    quantization = expected.
    """
    formats = _validate_list("formats", formats, FORMATS, FORMATS)
    if BASELINE not in formats:
        formats.insert(0, BASELINE)  # every speedup and error check is relative to BF16
    modes = _validate_list("modes", modes, MODES, MODES)
    dev = _resolve_device(device)
    _check_counts(repeats, warmup, bf16_step_time_s, compile_quant)
    shape_list, config, request_model, request_shapes = _shape_plan(
        model, shapes, micro_batch=micro_batch, seq_len=seq_len, gated_mlp=gated_mlp, no_gqa=no_gqa,
        vocab_size=vocab_size)
    # The request re-runs this benchmark: run_gemm_benchmark(**result["request"]) (Celery tasks, the API).
    request = {"model": request_model, "shapes": request_shapes, "micro_batch": micro_batch, "seq_len": seq_len,
               "formats": formats, "modes": modes, "gated_mlp": gated_mlp, "no_gqa": no_gqa,
               "vocab_size": vocab_size, "repeats": repeats, "warmup": warmup, "device": str(device),
               "bf16_step_time_s": bf16_step_time_s, "compile_quant": compile_quant, "seed": seed}
    low = [f for f in formats if f != BASELINE]
    ops = _format_ops(low, dev)
    bench = _Bench(dev=dev, gen=torch.Generator(device=dev).manual_seed(seed), warmup=warmup, repeats=repeats,
                   modes=modes, ops=ops, say=progress or (lambda msg: None),
                   quantizers={fmt: _Quantizers(o, compile_quant) for fmt, o in ops.items()
                               if not isinstance(o, Exception)})
    if "quant" in modes:
        bench.plans = {fmt: step_tensors(shape_list, bench.supported(fmt)) for fmt in low}
    records: list[dict] = []
    for si, shape in enumerate(shape_list):
        records += bench.shape_records(si, shape, formats)
    quant_tensors = [row for fmt in (low if "quant" in modes else []) for row in bench.quantization_rows(fmt, records)]
    totals = aggregate(records, formats, modes)
    return {
        "schema": SCHEMA, "request": request,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": _device_info(dev), "versions": _versions(), "git": _git_commit(), "config": config,
        "formats": formats, "modes": modes, "repeats": repeats, "warmup": warmup,
        "protocol": PROTOCOL if dev.type == "cuda" else "wall clock per call (CPU)",
        "bf16_step_time_s": bf16_step_time_s,
        "shapes": [s.to_dict() for s in shape_list],
        "results": records,
        "quantization": {"tensors": quant_tensors,
                         "model": "per layer and step: X, W, dY each quantized once per layout its GEMMs read, by "
                                  "the recipe's training quantizer (training/gemm/quantization.py); per-GEMM "
                                  "quant_s is the GEMM's equal share of its two tensors' time"},
        "totals": totals,
        "bf16_layers": list(BF16_LAYERS),
        "prediction": predictions(totals, bf16_step_time_s),
        "failures": _failures(records, quant_tensors),
    }


def _failures(records: list, quant_tensors: list) -> list[str]:
    failures = [f"{r['layer']}.{r['gemm']} {r['m']}x{r['k']}x{r['n']} {r['format']}/{r['mode']}: "
                + (f"relative error {r['rel_error']:.4g} > bound {r['error_bound']}" if r["check"] == "fail"
                   else r["note"])
                for r in records if r["check"] in ("fail", "error")]
    return failures + [f"quantization {r['format']} {r['tensor']}: {r['error']}" for r in quant_tensors
                       if r.get("error")]
