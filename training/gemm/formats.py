"""The GEMM benchmark's formats and operands: one pass's stored BF16 operands, and its kernel-only GEMM.

The formats are the recipe catalog's (`catalog.gemm_formats()`: every recipe that owns its GEMM operands, BF16
first). How a format quantizes each training-step tensor and runs a GEMM pass lives in its recipe
(`Recipe.gemm_ops(device)` -> `GemmOps`, training/precision/gemm_ops.py, which also has the table of passes,
operands and layouts); this module only talks to that interface. Storage (`make_operands`) is the one a real
linear layer has: fprop (X, W), dgrad (dY, W), wgrad (dY, X), all row-major. Kernel-only mode (`prepare`)
times the GEMM on operands quantized beforehand; the "with quantization" mode (quantization.py) times each
tensor's training quantizer once per step - as training quantizes each tensor once per layout - and adds it
to the GEMMs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from training.precision.catalog import BASELINE, GEMM_MODES, gemm_formats
from training.precision.gemm_ops import (EMULATED_LABEL, LAYOUTS, PASS_OPERANDS, ROLES, GemmOps, UnsupportedShape,
                                         sm_version)
from training.precision.registry import get_recipe

FORMATS = gemm_formats()
MODES = GEMM_MODES
# Relative Frobenius error ‖C − C_bf16‖ / ‖C_bf16‖ allowed for a GEMM of Gaussian operands, per format (each
# recipe's `gemm_error_bound`, with its reasoning).
ERROR_BOUNDS = {fmt: get_recipe(fmt).gemm_error_bound for fmt in FORMATS if fmt != BASELINE}

__all__ = ["FORMATS", "MODES", "ERROR_BOUNDS", "EMULATED_LABEL", "LAYOUTS", "PASS_OPERANDS", "ROLES", "GemmOps",
           "UnsupportedShape", "PreparedGemm", "sm_version", "storage_dims", "make_operands", "logical_operands",
           "format_ops", "prepare"]


@dataclass
class PreparedGemm:
    """`run(i)` computes the GEMM on operand buffer i; `backend` is real | emulated | cpu | bf16."""

    run: Callable[[int], torch.Tensor]
    backend: str
    note: str = ""


def storage_dims(gemm: str, m: int, k: int, n: int):
    """(rows, cols) of the stored A and B tensors of a pass (see the table in training/precision/gemm_ops.py)."""
    if gemm == "fprop":
        return (m, k), (n, k)
    if gemm == "dgrad":
        return (m, k), (k, n)
    if gemm == "wgrad":
        return (k, m), (k, n)
    raise ValueError(f"unknown gemm pass {gemm!r}; expected fprop, dgrad or wgrad")


def make_operands(shape, device: torch.device, generator: torch.Generator | None = None):
    """BF16 (A_storage, B_storage) for one pass, in the layout the training step stores them."""
    (ra, ca), (rb, cb) = storage_dims(shape.gemm, shape.m, shape.k, shape.n)
    kw = dict(device=device, dtype=torch.bfloat16, generator=generator)
    return torch.randn(ra, ca, **kw), torch.randn(rb, cb, **kw)


def logical_operands(gemm: str, a_store: torch.Tensor, b_store: torch.Tensor):
    """Views A (m×k), B (k×n) of the stored operands (no copies)."""
    a = a_store.t() if gemm == "wgrad" else a_store
    b = b_store.t() if gemm == "fprop" else b_store
    return a, b


def format_ops(fmt: str, device: torch.device) -> GemmOps:
    """The quantizers and GEMMs of low-precision format `fmt` on `device` (UnsupportedShape if it has none there)."""
    low = [f for f in FORMATS if f != BASELINE]
    if fmt not in low:
        raise ValueError(f"unknown low-precision format {fmt!r}; choose from {', '.join(low)}")
    return get_recipe(fmt).gemm_ops(device)


def prepare(fmt: str, shape, buffers, device: torch.device) -> PreparedGemm:
    """Kernel-only: a callable computing C = A·B on operand buffer i in format `fmt`, every buffer's
    operands quantized here, outside the timed region (for a format emulated here the timed "kernel" is the
    recipe's kernel-only emulation, e.g. dequantize + BF16 GEMM). `buffers` are (A_storage, B_storage) BF16
    pairs from `make_operands`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if fmt == BASELINE:
        views = [logical_operands(shape.gemm, a, b) for a, b in buffers]
        return PreparedGemm(lambda i: torch.mm(*views[i]), BASELINE)
    ops = format_ops(fmt, device)
    ops.check_shape(shape)
    (role_a, layout_a), (role_b, layout_b) = PASS_OPERANDS[shape.gemm]
    qa, qb = ops.kernel_quantizer(role_a), ops.kernel_quantizer(role_b)
    pre = [(qa(a, (layout_a,))[0], qb(b, (layout_b,))[0]) for a, b in buffers]
    gemm = ops.gemm(shape.gemm)
    gemm(*pre[0])  # blockwise picks its GEMM backend here, so the note below is final
    return PreparedGemm(lambda i: gemm(*pre[i]), ops.backend, ops.note)
