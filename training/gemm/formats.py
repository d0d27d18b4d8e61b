"""How each number format runs one GEMM pass, in the two timing modes.

Operand storage per pass follows the training step (see shapes.py), so layouts are the ones a real
linear layer sees:

    fprop  A = x   (T×in, row-major)        B = Wᵀ  with W (out×in) row-major
    dgrad  A = dy  (T×out, row-major)       B = W   (out×in) row-major
    wgrad  A = dyᵀ with dy (T×out)          B = x   (T×in) row-major

Recipes (what was chosen, following torchao 0.18):
- fp8_tensorwise: one scale per tensor (448/amax, current scaling). E4M3 for x and W, E5M2 for dy (torchao
  `Float8LinearConfig()` default); fast accumulation on fprop only (torchao `gemm_config_output`).
- fp8_rowwise: one scale per row of A and per column of B along K, E4M3 everywhere, scales rounded down
  to a power of two (torchao recipe `rowwise`).
- fp8_blockwise: 1×128 activation/gradient tiles and 128×128 weight tiles, E4M3, torchao's prototype
  Triton quantizers and its cuBLAS blockwise GEMM, or its Triton GEMM where cuBLAS lacks blockwise
  scaling (`torchao.prototype.blockwise_fp8_training`, SM90+).
- mxfp8 (E4M3, 32-element blocks, E8M0 scales, RCEIL) and nvfp4 (E2M1, 16-element blocks, E4M3 scales
  and a per-tensor FP32 scale): torchao kernels on SM100+; elsewhere emulated by quantize → dequantize
  → BF16 GEMM, labelled as such.

Modes: `kernel` times the GEMM on operands quantized beforehand (for emulated formats: dequantize +
BF16 GEMM, which is what the emulated kernel does); `quant` puts the quantization of both operands inside
the timed region, as in training: torchao's float8 linear likewise keeps BF16 tensors and casts both
operands of each of the three GEMMs (in the layout that GEMM needs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

FORMATS = ("bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4")
MODES = ("kernel", "quant")

# Relative Frobenius error ‖C − C_bf16‖ / ‖C_bf16‖ allowed for a GEMM of Gaussian operands. Expected
# values (two quantized operands, errors add in quadrature): E4M3 ≈ 0.04, E5M2 grads ≈ 0.07,
# E2M1 ≈ 0.13. The bounds leave ~2× head-room for shape effects yet fail a broken quantizer (≈ 1).
ERROR_BOUNDS = {
    "fp8_tensorwise": 0.12,
    "fp8_rowwise": 0.08,
    "fp8_blockwise": 0.08,
    "mxfp8": 0.08,
    "nvfp4": 0.25,
}

EMULATED_LABEL = "emulated – no hardware support"
# Operand roles per pass: they decide the FP8 element type (gradients → E5M2 in tensorwise).
OPERAND_ROLES = {"fprop": ("input", "weight"), "dgrad": ("grad_output", "weight"),
                 "wgrad": ("grad_output", "input")}
_EPS = 1e-12
_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class UnsupportedShape(Exception):
    """The format cannot run this shape (e.g. dims not multiples of 16); training keeps it in BF16."""


@dataclass
class PreparedGemm:
    """`run(i)` computes the GEMM on operand buffer i; `backend` is real | emulated | cpu | bf16."""

    run: Callable[[int], torch.Tensor]
    backend: str
    note: str = ""


def sm_version(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def make_operands(shape, device: torch.device, generator: torch.Generator | None = None):
    """BF16 (A_storage, B_storage) for one pass, in the layout the training step stores them."""
    m, k, n = shape.m, shape.k, shape.n
    kw = dict(device=device, dtype=torch.bfloat16)
    if shape.gemm == "fprop":
        return torch.randn(m, k, **kw, generator=generator), torch.randn(n, k, **kw, generator=generator)
    if shape.gemm == "dgrad":
        return torch.randn(m, k, **kw, generator=generator), torch.randn(k, n, **kw, generator=generator)
    if shape.gemm == "wgrad":
        return torch.randn(k, m, **kw, generator=generator), torch.randn(k, n, **kw, generator=generator)
    raise ValueError(f"unknown gemm pass {shape.gemm!r}; expected fprop, dgrad or wgrad")


def logical_operands(gemm: str, a_store: torch.Tensor, b_store: torch.Tensor):
    """Views A (m×k), B (k×n) of the stored operands (no copies)."""
    a = a_store.t() if gemm == "wgrad" else a_store
    b = b_store.t() if gemm == "fprop" else b_store
    return a, b


# ---------------------------------------------------------------------------------------------------
# FP8 current-scaling quantizers. Each takes a 2-D view X (r×k, any strides) and returns X quantized in
# row-major layout with its inverse scale, so A is quantized as-is and B through Bᵀ (n×k) – which gives
# the column-major B that torch._scaled_mm needs. In quant mode on CUDA they run compiled together with
# the GEMM (fp8_quant_gemm); eager they would cost ~6 memory passes per operand.
# ---------------------------------------------------------------------------------------------------

def fp8_tensorwise_quantize(x: torch.Tensor, dtype: torch.dtype):
    fmax = torch.finfo(dtype).max
    amax = x.abs().max().to(torch.float32)
    scale = fmax / torch.clamp(amax, min=_EPS)
    q = (x.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype).contiguous()
    return q, scale.reciprocal()


def fp8_rowwise_quantize(x: torch.Tensor, dtype: torch.dtype):
    fmax = torch.finfo(dtype).max
    amax = x.abs().amax(dim=1, keepdim=True).to(torch.float32)
    # Power-of-two scales (torchao `round_scales_to_power_of_2=True` in its rowwise recipe).
    scale = torch.exp2(torch.floor(torch.log2(fmax / torch.clamp(amax, min=_EPS))))
    q = (x.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype).contiguous()
    return q, scale.reciprocal()


# ---------------------------------------------------------------------------------------------------
# Emulation (formats without hardware support here): quantize → dequantize → BF16 GEMM.
# ---------------------------------------------------------------------------------------------------

def emulation_quantize_dequantize(x: torch.Tensor, fmt: str, block_size=None) -> torch.Tensor:
    """Quantize → dequantize `x` (blocks along its last dim) for the emulated GEMM path.

    The one quantizer of the project, `training.precision.quantize_dequantize` (bit-exact with torchao's
    reference quantizers by its contract). Operands whose K is not the contiguous dim (B of fprop, A of
    wgrad) are made contiguous first, as a real quantization kernel writes them in the K-major layout
    the GEMM needs.
    """
    from training.precision import quantize_dequantize
    x = x.contiguous()
    if fmt == "mxfp8":
        return quantize_dequantize(x, fmt, scale_rounding="rceil")
    return quantize_dequantize(x, fmt, block_size=block_size)


def _emulation_quantize(x: torch.Tensor, fmt: str):
    """Stored (quantized) form for the kernel-only emulated mode; `.dequantize()` is timed."""
    if fmt == "mxfp8":
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        return MXTensor.to_mx(x.contiguous(), _E4M3, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    x = x.contiguous()
    return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max()))


# ---------------------------------------------------------------------------------------------------
# Preparation per format
# ---------------------------------------------------------------------------------------------------

_compiled: dict = {}


def _maybe_compiled(fn, device: torch.device, compile_quant: bool):
    if device.type != "cuda" or not compile_quant:
        return fn
    if fn not in _compiled:
        import torch._dynamo
        # One graph per (dtype, flags, stride pattern); shapes are dynamic so all layers share it.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


def _check_divisible(shape, fmt: str, multiple: int, dims: str = "mkn"):
    bad = [f"{d.upper()}={getattr(shape, d)}" for d in dims if getattr(shape, d) % multiple]
    if bad:
        raise UnsupportedShape(f"{fmt} needs {', '.join(d.upper() for d in dims)} divisible by {multiple} "
                               f"(got {', '.join(bad)}); training keeps such a layer in BF16")


def prepare(fmt: str, mode: str, shape, buffers, device: torch.device, *,
            compile_quant: bool = True) -> PreparedGemm:
    """A callable computing C = A·B for operand buffer i in format `fmt`, timing mode `mode`.

    `buffers` is a list of (A_storage, B_storage) BF16 pairs from `make_operands`. Kernel-only mode
    quantizes every buffer here, outside the timed region.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose kernel or quant")
    views = [logical_operands(shape.gemm, a, b) for a, b in buffers]
    if fmt == "bf16":
        return PreparedGemm(lambda i: torch.mm(*views[i]), "bf16")
    sm = sm_version(device)
    if fmt in ("fp8_tensorwise", "fp8_rowwise"):
        return _prepare_fp8_scaled_mm(fmt, mode, shape, views, device, compile_quant)
    if fmt == "fp8_blockwise":
        _check_divisible(shape, fmt, 128)
        if sm >= 90:
            return _prepare_blockwise_real(mode, shape, buffers)
        return _prepare_emulated(fmt, mode, shape, views)
    _check_divisible(shape, fmt, 32 if fmt == "mxfp8" else 16, "k")  # blocks run along K
    if sm >= 100:
        return _prepare_mx_real(fmt, mode, views)
    return _prepare_emulated(fmt, mode, shape, views)


def fp8_quant_gemm(a: torch.Tensor, bt: torch.Tensor, dtype_a: torch.dtype, rowwise: bool,
                   fast_accum: bool) -> torch.Tensor:
    """Quantize A (m×k) and Bᵀ (n×k) with current scaling, then C = A·B on FP8 tensor cores."""
    quantize = fp8_rowwise_quantize if rowwise else fp8_tensorwise_quantize
    qa, sa = quantize(a, dtype_a)
    qbt, sbt = quantize(bt, _E4M3)
    return fp8_scaled_mm(qa, sa, qbt, sbt, fast_accum)


def fp8_scaled_mm(qa, sa, qbt, sbt, fast_accum: bool) -> torch.Tensor:
    # Rowwise scales of B come as (n, 1) from quantizing Bᵀ; _scaled_mm wants (1, n).
    return torch._scaled_mm(qa, qbt.t(), scale_a=sa, scale_b=sbt.t() if sbt.dim() else sbt,
                            out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def _prepare_fp8_scaled_mm(fmt, mode, shape, views, device, compile_quant) -> PreparedGemm:
    _check_divisible(shape, fmt, 16, "kn")  # torch._scaled_mm needs K and N multiples of 16
    if device.type == "cuda" and sm_version(device) < 89:
        raise UnsupportedShape(f"{fmt} needs FP8 tensor cores (SM89+); this GPU is SM{sm_version(device)}")
    rowwise = fmt == "fp8_rowwise"
    dtype_a = _E5M2 if not rowwise and OPERAND_ROLES[shape.gemm][0] == "grad_output" else _E4M3
    fast_accum = shape.gemm == "fprop" and device.type == "cuda"
    backend = "real" if device.type == "cuda" else "cpu"
    if mode == "kernel":
        quantize = fp8_rowwise_quantize if rowwise else fp8_tensorwise_quantize
        pre = [(*quantize(a, dtype_a), *quantize(b.t(), _E4M3)) for a, b in views]
        return PreparedGemm(lambda i: fp8_scaled_mm(*pre[i], fast_accum), backend)

    def eager(i):
        a, b = views[i]
        return fp8_quant_gemm(a, b.t(), dtype_a, rowwise, fast_accum)
    if device.type != "cuda" or not compile_quant:
        return PreparedGemm(eager, backend, "quantizers eager")
    # One compiled graph for quantize A, quantize B and the GEMM, as torchao's float8 training runs under
    # torch.compile: amax, scale, cast and transpose fuse, and one guard check replaces a dozen eager
    # launches that would otherwise make small GEMMs CPU-bound.
    fused = _maybe_compiled(fp8_quant_gemm, device, compile_quant)

    def compiled(i):
        a, b = views[i]
        return fused(a, b.t(), dtype_a, rowwise, fast_accum)
    try:
        compiled(0)
    except Exception as exc:  # noqa: BLE001 - time the eager path rather than lose the format
        return PreparedGemm(eager, backend, f"quantizers eager (torch.compile failed: {exc})"[:300])
    return PreparedGemm(compiled, backend, "quantize+GEMM compiled (torch.compile)")


def _prepare_blockwise_real(mode, shape, buffers) -> PreparedGemm:
    from torchao.prototype.blockwise_fp8_training import kernels as bk
    from torchao.prototype.blockwise_fp8_training.linear import _run_blockwise_mm

    def quantize_pair(i):
        a_st, b_st = buffers[i]
        if shape.gemm == "fprop":  # x (m×k) 1×128; W (n×k) 128×128, written transposed (k×n col-major)
            qa, sa = bk.triton_fp8_blockwise_act_quant_lhs(a_st, 128)
            qb, sb = bk.triton_fp8_blockwise_weight_quant_transposed_rhs(b_st, block_size=128)
        elif shape.gemm == "dgrad":  # dy (m×k) 1×128; W (k×n) 128×128
            qa, sa = bk.triton_fp8_blockwise_act_quant_lhs(a_st, 128)
            qb, sb = bk.triton_fp8_blockwise_weight_quant_rhs(b_st, block_size=128)
        else:  # dyᵀ 1×128 along tokens; x 128×1 along tokens (scaling groups never cross K)
            qa, sa = bk.triton_fp8_blockwise_act_quant_transposed_lhs(a_st, 128)
            qb, sb = bk.triton_fp8_blockwise_act_quant_rhs(b_st, 128)
        return qa, sa, qb, sb

    def gemm(qa, sa, qb, sb, use_triton):
        if shape.gemm == "wgrad":
            return _run_blockwise_mm(use_triton=use_triton, triton_kernel=bk.triton_fp8_gemm_1x128_128x1,
                                     mat_a=qa, mat_b=qb, scale_a=sa,
                                     scale_recipe_a=bk.BLOCKWISE_1X128_SCALING_TYPE,
                                     scale_b=sb.transpose(-1, -2),
                                     scale_recipe_b=bk.BLOCKWISE_1X128_SCALING_TYPE,
                                     triton_scale_b=sb, out_dtype=torch.bfloat16)
        return _run_blockwise_mm(use_triton=use_triton, triton_kernel=bk.triton_fp8_gemm_1x128_128x128,
                                 mat_a=qa, mat_b=qb, scale_a=sa,
                                 scale_recipe_a=bk.BLOCKWISE_1X128_SCALING_TYPE, scale_b=sb,
                                 scale_recipe_b=bk.BLOCKWISE_128X128_SCALING_TYPE,
                                 out_dtype=torch.bfloat16)

    # torchao's default GEMM is cuBLAS blockwise (CUDA ≥ 12.9 on SM90); where this torch/cuBLAS lacks it,
    # torchao's Triton blockwise GEMM is the one training would use, so time that instead.
    use_triton = False
    note = "torchao Triton quantizers + cuBLAS blockwise GEMM"
    try:
        gemm(*quantize_pair(0), use_triton=False)
    except Exception as exc:  # noqa: BLE001 - any failure of the cuBLAS path means "not available here"
        use_triton = True
        note = f"torchao Triton quantizers + Triton blockwise GEMM (cuBLAS blockwise failed: {exc})"[:300]
    if mode == "kernel":
        pre = [quantize_pair(i) for i in range(len(buffers))]
        return PreparedGemm(lambda i: gemm(*pre[i], use_triton), "real", note)
    return PreparedGemm(lambda i: gemm(*quantize_pair(i), use_triton), "real", note)


def _prepare_mx_real(fmt, mode, views) -> PreparedGemm:
    from torch.ops import aten

    if fmt == "mxfp8":
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor, _addmm_mx_dispatch
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        def quantize(x):
            return MXTensor.to_mx(x.contiguous(), _E4M3, 32, scaling_mode=ScaleCalculationMode.RCEIL,
                                  kernel_preference=KernelPreference.AUTO)
        dispatch = _addmm_mx_dispatch
    else:
        from torchao.prototype.mx_formats.nvfp4_tensor import (NVFP4Tensor, _addmm_nvfp4_dispatch,
                                                               per_tensor_amax_to_scale)

        def quantize(x):
            x = x.contiguous()
            return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max()))
        dispatch = _addmm_nvfp4_dispatch

    def quantize_pair(i):
        a, b = views[i]
        return quantize(a), quantize(b.t()).t()

    note = "torchao CUTLASS/cuBLAS block-scaled GEMM (scale swizzle inside the timed region)"
    if mode == "kernel":
        pre = [quantize_pair(i) for i in range(len(views))]
        return PreparedGemm(lambda i: dispatch(*pre[i], aten.mm.default), "real", note)
    return PreparedGemm(lambda i: dispatch(*quantize_pair(i), aten.mm.default), "real", note)


def _prepare_emulated(fmt, mode, shape, views) -> PreparedGemm:
    if fmt == "fp8_blockwise":
        # Activations/gradients: 1×128 along K; weights: 128×128 (torchao's blockwise recipe).
        b_is_weight = OPERAND_ROLES[shape.gemm][1] == "weight"

        def qdq_pair(i):
            a, b = views[i]
            qb_t = emulation_quantize_dequantize(b.t(), fmt, (128, 128) if b_is_weight else 128)
            return emulation_quantize_dequantize(a, fmt, 128), qb_t.t()
        note = EMULATED_LABEL
        if mode == "kernel":
            # Stored dequantized: the emulated "kernel" is then exactly the BF16 GEMM it runs.
            pre = [qdq_pair(i) for i in range(len(views))]
            return PreparedGemm(lambda i: torch.mm(*pre[i]), "emulated", note)
        return PreparedGemm(lambda i: torch.mm(*qdq_pair(i)), "emulated", note)

    note = EMULATED_LABEL
    if mode == "kernel":
        # The stored form is the quantized tensor; the emulated kernel dequantizes and runs a BF16 GEMM.
        pre = [(_emulation_quantize(a, fmt), _emulation_quantize(b.t(), fmt)) for a, b in views]
        return PreparedGemm(
            lambda i: torch.mm(pre[i][0].dequantize(torch.bfloat16), pre[i][1].dequantize(torch.bfloat16).t()),
            "emulated", note)

    def run_quant(i):
        a, b = views[i]
        return torch.mm(emulation_quantize_dequantize(a, fmt), emulation_quantize_dequantize(b.t(), fmt).t())
    return PreparedGemm(run_quant, "emulated", note)
