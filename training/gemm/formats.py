"""How each number format quantizes a training-step tensor and runs one GEMM pass on quantized operands.

A linear layer y = x·Wᵀ has three tensors per step - X (T×in, "input"), W (out×in, "weight") and
dY (T×out, "grad_output") - and three GEMMs. Each GEMM reads two of the tensors, each in one of two
layouts: "row" (the tensor as stored, quantized along its rows, i.e. along its last dim) or "t" (its
transpose, quantized along the stored tensor's first dim):

    pass    A (m×k)            B (k×n), given as Bᵀ (n×k)      torchao float8 cast (Float8Linear)
    fprop   X   row            W   row   (Bᵀ = W)              input dim -1, weight
    dgrad   dY  row            W   t     (Bᵀ = Wᵀ)             grad_output dim -1, weight for grad_input
    wgrad   dY  t  (A = dYᵀ)   X   t     (Bᵀ = Xᵀ)             grad_output dim 0,  input for grad_weight

Storage (`make_operands`) is the one a real linear layer has: fprop (X, W), dgrad (dY, W), wgrad (dY, X),
all row-major. A quantizer maps a stored tensor and the layouts it is needed in to one quantized operand
per layout; a GEMM maps the quantized A and Bᵀ to C. Kernel-only mode times the GEMM on operands
quantized beforehand; the "with quantization" mode (see quantization.py) times each tensor's quantizer
once per step - as training quantizes each tensor once per layout - and adds it to the GEMMs.

Recipes (following torchao 0.18):
- fp8_tensorwise: one scale per tensor (448/amax, current scaling), shared by both layouts of the tensor
  (one amax reduction, two casts). E4M3 for X and W, E5M2 for dY (torchao `Float8LinearConfig()`
  default); fast accumulation on fprop only (torchao `gemm_config_output`; grad GEMMs without).
- fp8_rowwise: one scale per row of each layout (so two amax reductions per tensor), E4M3 everywhere,
  scales rounded down to a power of two (torchao recipe `rowwise`; fast accumulation on fprop as well,
  its `gemm_config_output` keeps the default).
- fp8_blockwise: 1×128 activation/gradient tiles and 128×128 weight tiles, E4M3, torchao's prototype
  Triton quantizers (the six of `fp8_blockwise_mm`) and its cuBLAS blockwise GEMM, or its Triton GEMM where
  cuBLAS lacks blockwise scaling (`torchao.prototype.blockwise_fp8_training`, SM90+).
- mxfp8 (E4M3, 32-element blocks, E8M0 scales, RCEIL) and nvfp4 (E2M1, 16-element blocks, E4M3 scales
  and a per-tensor FP32 scale): torchao quantizers; its block-scaled GEMMs on SM100+, elsewhere the
  emulated GEMM (dequantize → BF16 GEMM, torchao's `KernelPreference.EMULATED` path), labelled as such.
On CUDA the FP8 tensorwise/rowwise quantizers run under torch.compile (static shapes, as the training
step is compiled), where amax, scale, cast and transposed write fuse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

FORMATS = ("bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4")
MODES = ("kernel", "quant")
ROLES = ("input", "weight", "grad_output")
LAYOUTS = ("row", "t")
# (role, layout) of A and of B per pass; see the table above.
PASS_OPERANDS = {
    "fprop": (("input", "row"), ("weight", "row")),
    "dgrad": (("grad_output", "row"), ("weight", "t")),
    "wgrad": (("grad_output", "t"), ("input", "t")),
}

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


def storage_dims(gemm: str, m: int, k: int, n: int):
    """(rows, cols) of the stored A and B tensors of a pass (see the module table)."""
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


# ---------------------------------------------------------------------------------------------------
# FP8 current scaling. `fp8_quantize_layouts(x, ...)` returns, per requested layout, the row-major FP8
# matrix (x or xᵀ) and its inverse scale (a scalar, or one per row of that matrix for rowwise).
# ---------------------------------------------------------------------------------------------------

def fp8_tensorwise_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fmax / amax(x): one FP32 scale for the whole tensor."""
    return torch.finfo(dtype).max / torch.clamp(x.abs().max().to(torch.float32), min=_EPS)


def fp8_rowwise_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One power-of-two scale per row (torchao `round_scales_to_power_of_2=True` in its rowwise recipe)."""
    amax = x.abs().amax(dim=1, keepdim=True).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(torch.finfo(dtype).max / torch.clamp(amax, min=_EPS))))


def fp8_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype).contiguous()


def fp8_quantize_layouts(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, layouts: tuple):
    """Training's FP8 cast of one tensor: ((q, inv_scale) per layout). Tensorwise: one amax for all
    layouts (torchao casts a tensor for its two GEMMs with the same scale); rowwise: one per layout."""
    shared = None if rowwise else fp8_tensorwise_scale(x, dtype)
    out = []
    for layout in layouts:
        src = x if layout == "row" else x.t()
        scale = fp8_rowwise_scale(src, dtype) if rowwise else shared
        out.append((fp8_cast(src, scale, dtype), scale.reciprocal()))
    return tuple(out)


def fp8_scaled_mm(qa, sa, qbt, sbt, fast_accum: bool) -> torch.Tensor:
    """C = A·B from row-major FP8 A (m×k) and Bᵀ (n×k); rowwise scales of Bᵀ come as (n, 1)."""
    return torch._scaled_mm(qa, qbt.t(), scale_a=sa, scale_b=sbt.t() if sbt.dim() else sbt,
                            out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


# ---------------------------------------------------------------------------------------------------
# Emulation helpers (formats without hardware support here).
# ---------------------------------------------------------------------------------------------------

def emulation_quantize_dequantize(x: torch.Tensor, fmt: str, block_size=None) -> torch.Tensor:
    """Quantize → dequantize `x` (blocks along its last dim) with the project's quantizer
    (`training.precision.quantize_dequantize`, bit-exact with torchao's reference quantizers by its
    contract); `x` is made contiguous first, as a quantization kernel writes the layout the GEMM needs."""
    from training.precision import quantize_dequantize
    x = x.contiguous()
    if fmt == "mxfp8":
        return quantize_dequantize(x, fmt, scale_rounding="rceil")
    return quantize_dequantize(x, fmt, block_size=block_size)


def mx_quantize(x: torch.Tensor, fmt: str, real: bool):
    """torchao's stored form of `x` (blocks along the last dim): MXTensor (mxfp8) or NVFP4Tensor."""
    x = x.contiguous()
    if fmt == "mxfp8":
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        kwargs = {}
        if real:
            from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
            kwargs["kernel_preference"] = KernelPreference.AUTO
        return MXTensor.to_mx(x, _E4M3, 32, scaling_mode=ScaleCalculationMode.RCEIL, **kwargs)
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max()))


# ---------------------------------------------------------------------------------------------------
# Per format: shape check, tensor quantizer, GEMM on quantized operands.
# ---------------------------------------------------------------------------------------------------

_compiled: dict = {}


def _compiled_fn(fn):
    if fn not in _compiled:
        import torch._dynamo
        # Static shapes, one graph per tensor shape × (dtype, layouts), as the compiled training step has;
        # a model has about a dozen distinct tensor shapes per format.
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


def _check_divisible(shape, fmt: str, multiple: int, dims: str = "mkn"):
    bad = [f"{d.upper()}={getattr(shape, d)}" for d in dims if getattr(shape, d) % multiple]
    if bad:
        raise UnsupportedShape(f"{fmt} needs {', '.join(d.upper() for d in dims)} divisible by {multiple} "
                               f"(got {', '.join(bad)}); training keeps such a layer in BF16")


class FormatOps:
    """The quantizers and GEMMs of one low-precision format on one device.

    `quantizer(role, compiled)` → q(x, layouts) returning one quantized operand per layout;
    `gemm(pass)` → g(qa, qbt) returning C in BF16. `backend` is real | emulated | cpu.
    """

    def __init__(self, fmt: str, device: torch.device):
        if fmt not in FORMATS or fmt == "bf16":
            raise ValueError(f"unknown low-precision format {fmt!r}; choose from {', '.join(FORMATS[1:])}")
        self.fmt, self.device, self.sm = fmt, device, sm_version(device)
        self._use_triton_blockwise: bool | None = None
        if fmt in ("fp8_tensorwise", "fp8_rowwise"):
            if device.type == "cuda" and self.sm < 89:
                raise UnsupportedShape(f"{fmt} needs FP8 tensor cores (SM89+); this GPU is SM{self.sm}")
            self.backend, self.note = ("real" if device.type == "cuda" else "cpu"), ""
        elif fmt == "fp8_blockwise":
            real = self.sm >= 90
            self.backend = "real" if real else "emulated"
            self.note = "torchao Triton quantizers + cuBLAS blockwise GEMM" if real else EMULATED_LABEL
        else:
            real = self.sm >= 100
            self.backend = "real" if real else "emulated"
            self.note = ("torchao CUTLASS/cuBLAS block-scaled GEMM (scale swizzle inside the timed region)"
                         if real else EMULATED_LABEL)

    # -- shapes --------------------------------------------------------------------------------------
    def check_shape(self, shape) -> None:
        if self.fmt in ("fp8_tensorwise", "fp8_rowwise"):
            _check_divisible(shape, self.fmt, 16, "kn")  # torch._scaled_mm: K and N multiples of 16
        elif self.fmt == "fp8_blockwise":
            _check_divisible(shape, self.fmt, 128)
        else:
            _check_divisible(shape, self.fmt, 32 if self.fmt == "mxfp8" else 16, "k")  # blocks along K

    # -- quantizers ----------------------------------------------------------------------------------
    def quantizer(self, role: str, compiled: bool = False) -> Callable:
        if role not in ROLES:
            raise ValueError(f"unknown operand role {role!r}; expected one of {', '.join(ROLES)}")
        fmt = self.fmt
        if fmt in ("fp8_tensorwise", "fp8_rowwise"):
            rowwise = fmt == "fp8_rowwise"
            dtype = _E5M2 if not rowwise and role == "grad_output" else _E4M3
            if compiled and self.device.type == "cuda":
                fn = _compiled_fn(fp8_quantize_layouts)
                return lambda x, layouts: fn(x, dtype, rowwise, tuple(layouts))
            return lambda x, layouts: fp8_quantize_layouts(x, dtype, rowwise, tuple(layouts))
        if fmt == "fp8_blockwise":
            if self.backend == "real":
                from torchao.prototype.blockwise_fp8_training import kernels as bk
                kernels = {  # the quantizers of torchao's fp8_blockwise_mm forward/backward
                    ("input", "row"): lambda x: bk.triton_fp8_blockwise_act_quant_lhs(x, 128),
                    ("input", "t"): lambda x: bk.triton_fp8_blockwise_act_quant_rhs(x, 128),
                    ("weight", "row"): lambda x: bk.triton_fp8_blockwise_weight_quant_transposed_rhs(x, block_size=128),
                    ("weight", "t"): lambda x: bk.triton_fp8_blockwise_weight_quant_rhs(x, block_size=128),
                    ("grad_output", "row"): lambda x: bk.triton_fp8_blockwise_act_quant_lhs(x, 128),
                    ("grad_output", "t"): lambda x: bk.triton_fp8_blockwise_act_quant_transposed_lhs(x, 128),
                }
                return lambda x, layouts: tuple(kernels[(role, layout)](x) for layout in layouts)
            block = (128, 128) if role == "weight" else 128
            return lambda x, layouts: tuple(
                emulation_quantize_dequantize(x if layout == "row" else x.t(), fmt, block) for layout in layouts)
        real = self.backend == "real"
        return lambda x, layouts: tuple(mx_quantize(x if layout == "row" else x.t(), fmt, real)
                                        for layout in layouts)

    # -- GEMMs ---------------------------------------------------------------------------------------
    def gemm(self, gemm: str) -> Callable:
        if gemm not in PASS_OPERANDS:
            raise ValueError(f"unknown gemm pass {gemm!r}; expected fprop, dgrad or wgrad")
        fmt = self.fmt
        if fmt in ("fp8_tensorwise", "fp8_rowwise"):
            fast_accum = gemm == "fprop" and self.device.type == "cuda"
            return lambda qa, qbt: fp8_scaled_mm(*qa, *qbt, fast_accum)
        if fmt == "fp8_blockwise":
            if self.backend == "real":
                return lambda qa, qbt: self._blockwise_gemm(gemm, qa, qbt)
            return lambda qa, qbt: torch.mm(qa, qbt.t())
        if self.backend == "real":
            from torch.ops import aten
            if fmt == "mxfp8":
                from torchao.prototype.mx_formats.mx_tensor import _addmm_mx_dispatch as dispatch
            else:
                from torchao.prototype.mx_formats.nvfp4_tensor import _addmm_nvfp4_dispatch as dispatch
            return lambda qa, qbt: dispatch(qa, qbt.t(), aten.mm.default)
        return lambda qa, qbt: torch.mm(qa.dequantize(torch.bfloat16), qbt.dequantize(torch.bfloat16).t())

    def _blockwise_gemm(self, gemm, qa, qbt):
        from torchao.prototype.blockwise_fp8_training import kernels as bk
        from torchao.prototype.blockwise_fp8_training.linear import _run_blockwise_mm

        def run(use_triton):
            (a, sa), (b, sb) = qa, qbt
            if gemm == "wgrad":
                return _run_blockwise_mm(use_triton=use_triton, triton_kernel=bk.triton_fp8_gemm_1x128_128x1,
                                         mat_a=a, mat_b=b, scale_a=sa,
                                         scale_recipe_a=bk.BLOCKWISE_1X128_SCALING_TYPE,
                                         scale_b=sb.transpose(-1, -2),
                                         scale_recipe_b=bk.BLOCKWISE_1X128_SCALING_TYPE,
                                         triton_scale_b=sb, out_dtype=torch.bfloat16)
            return _run_blockwise_mm(use_triton=use_triton, triton_kernel=bk.triton_fp8_gemm_1x128_128x128,
                                     mat_a=a, mat_b=b, scale_a=sa,
                                     scale_recipe_a=bk.BLOCKWISE_1X128_SCALING_TYPE, scale_b=sb,
                                     scale_recipe_b=bk.BLOCKWISE_128X128_SCALING_TYPE,
                                     out_dtype=torch.bfloat16)

        # torchao's default GEMM is cuBLAS blockwise (CUDA ≥ 12.9 on SM90); where this torch/cuBLAS lacks
        # it, torchao's Triton blockwise GEMM is the one training would use, so time that instead.
        if self._use_triton_blockwise is None:
            try:
                out = run(False)
                self._use_triton_blockwise = False
                return out
            except Exception as exc:  # noqa: BLE001 - any failure of the cuBLAS path: "not available here"
                self._use_triton_blockwise = True
                self.note = (f"torchao Triton quantizers + Triton blockwise GEMM (cuBLAS blockwise failed: "
                             f"{exc})")[:300]
        return run(self._use_triton_blockwise)


def prepare(fmt: str, shape, buffers, device: torch.device) -> PreparedGemm:
    """Kernel-only: a callable computing C = A·B on operand buffer i in format `fmt`, every buffer's
    operands quantized here, outside the timed region (for emulated formats the timed "kernel" is what
    the emulation runs: dequantize + BF16 GEMM for mxfp8/nvfp4, the BF16 GEMM of the dequantized values
    for blockwise). `buffers` are (A_storage, B_storage) BF16 pairs from `make_operands`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if fmt == "bf16":
        views = [logical_operands(shape.gemm, a, b) for a, b in buffers]
        return PreparedGemm(lambda i: torch.mm(*views[i]), "bf16")
    ops = FormatOps(fmt, device)
    ops.check_shape(shape)
    (role_a, layout_a), (role_b, layout_b) = PASS_OPERANDS[shape.gemm]
    qa, qb = ops.quantizer(role_a), ops.quantizer(role_b)
    pre = [(qa(a, (layout_a,))[0], qb(b, (layout_b,))[0]) for a, b in buffers]
    gemm = ops.gemm(shape.gemm)
    gemm(*pre[0])  # blockwise picks its GEMM backend here, so the note below is final
    return PreparedGemm(lambda i: gemm(*pre[i]), ops.backend, ops.note)
