"""Exact emulation of quantized training GEMMs, shared by every recipe.

A linear layer Y = X W^T runs three GEMMs. Written as `a @ b.T` with the reduction dimension last in
both operands (the layout every block format scales along):

    Fprop  Y  = X    @ W^T      a = X    [tokens, in],  b = W    [out, in]     reduce over in
    Dgrad  dX = dY   @ W        a = dY   [tokens, out], b = W^T  [in, out]     reduce over out
    Wgrad  dW = dY^T @ X        a = dY^T [out, tokens], b = X^T  [in, tokens]  reduce over tokens

A `GemmQuantizer` says how each operand is quantized; `EmulatedLinearFn` quantizes, dequantizes and
multiplies. Operands blocked along a dimension that is not the contiguous one (W for Dgrad, dY and X
for Wgrad) are quantized in place along axis 0 and handed to the GEMM as transposed views: no
transposed copies are written, the GEMM reads either layout.

Numerics of the GEMM:
  - On GPU, for formats whose dequantized values are exact in BF16 (MXFP8, NVFP4, FP8 per-tensor and
    power-of-two row scales; see formats.py) the quantizer writes the dequantized values (element x block
    scale) straight in BF16 and the GEMM is a plain BF16 `torch.mm`: cuBLAS multiplies exactly and
    accumulates in FP32 (as the BF16 baseline, subject to torch's allow_bf16_reduced_precision_reduction
    switch), then rounds the result once to BF16. A per-tensor FP32 `outer` scale (NVFP4's global scale,
    the FP8 per-tensor scale) is multiplied onto that BF16 result in FP32 and rounded again to the output
    dtype: the result is accumulator -> BF16 -> x outer -> BF16, a double rounding (at most one extra
    BF16 rounding, 2^-9 relative, far below the format's own error; MXFP8 has no outer scale and is
    rounded once). The real block-scaled kernels apply the global scale to the FP32 accumulator before
    their single rounding; we accept the extra rounding because an FP32-output GEMM (mm with
    out_dtype=float32) runs at a small fraction of BF16 speed on torch 2.11, which would make emulated
    runs useless for throughput-bound experiments. Under torch.compile the scale multiplication is an
    elementwise epilogue that inductor can fuse into the kernel that next reads the GEMM's output.
    NVFP4's Wgrad adds one more BF16 rounding on GPU, of its Hadamard transform (see nvfp4.py).
  - Formats with arbitrary FP32 block scales (fp8_blockwise) are not exact in BF16: FP32 values, FP32
    GEMM (autocast off), on GPU too.
  - On CPU: FP32 values and an FP32 GEMM, output scaled in FP32 and rounded once to the output dtype.

Precision of inputs and outputs: under CUDA autocast (FP32 parameters) the activation is quantized from
its autocast (BF16) copy, as the real kernels do, and the output is in the autocast dtype; without
autocast (e.g. BF16 parameters) it is in the activation's dtype. Gradients come back in the dtype of the
input and of the weight.
"""
from __future__ import annotations

import torch
from torch import nn

from training.precision.formats import Quantized


class GemmQuantizer:
    """How a recipe quantizes the operands of the three GEMMs (see the module docstring for the layouts).

    Every method takes `dtype` (the dtype of the dequantized `values`: FP32, or BF16 for the GPU GEMM)
    and `track=True` asks for saturation counts (numerics telemetry only). `bf16_exact=False` marks
    formats whose dequantized values are not exact in BF16 (the GEMM then stays FP32)."""

    bf16_exact = True

    def input(self, x2d: torch.Tensor, *, dtype=torch.float32, track: bool = False) -> Quantized:
        """Fprop operand a = X [tokens, in], blocks along in."""
        raise NotImplementedError

    def weight_fprop(self, w: torch.Tensor, *, dtype=torch.float32, track: bool = False) -> Quantized:
        """Fprop operand b = W [out, in], blocks along in."""
        raise NotImplementedError

    def weight_dgrad(self, w: torch.Tensor, *, dtype=torch.float32, track: bool = False) -> Quantized:
        """Dgrad operand b = W^T [in, out], blocks along out (a transposed view is fine)."""
        raise NotImplementedError

    def weight(self, w: torch.Tensor, *, track: bool = False) -> tuple[Quantized, Quantized]:
        """(Fprop operand W [out, in], Dgrad operand W^T [in, out]), FP32 values."""
        return self.weight_fprop(w, track=track), self.weight_dgrad(w)

    def grad(self, dy2d: torch.Tensor, *, dtype=torch.float32, track: bool = False) -> Quantized:
        """Dgrad operand a = dY [tokens, out], blocks along out."""
        raise NotImplementedError

    def grad_wgrad(self, dy2d: torch.Tensor, *, dtype=torch.float32) -> Quantized:
        """Wgrad operand a = dY^T [out, tokens] from dY [tokens, out], blocked along tokens (a transposed view
        is fine)."""
        raise NotImplementedError

    def input_wgrad(self, x2d: torch.Tensor, *, dtype=torch.float32) -> Quantized:
        """Wgrad operand b = X^T [in, tokens] from X [tokens, in], blocked along tokens."""
        raise NotImplementedError

    def wgrad(self, dy2d: torch.Tensor, x2d: torch.Tensor, *, dtype=torch.float32) -> tuple[Quantized, Quantized]:
        """Both Wgrad operands, (a = dY^T [out, tokens], b = X^T [in, tokens]); dY first (its stochastic
        rounding draws come first)."""
        return self.grad_wgrad(dy2d, dtype=dtype), self.input_wgrad(x2d, dtype=dtype)

    def describe(self) -> str:
        return type(self).__name__


def gemm_dtype(t: torch.Tensor, quantizer: GemmQuantizer | None = None) -> torch.dtype:
    """BF16 GEMMs on GPU where the dequantized values are exact in BF16 (`quantizer` None: FP8 codes,
    always exact), FP32 otherwise and on CPU."""
    exact = quantizer is None or quantizer.bf16_exact
    return torch.bfloat16 if t.is_cuda and exact else torch.float32


def emulated_mm_parts(a: Quantized, b: Quantized) -> tuple[torch.Tensor, torch.Tensor | None]:
    """emulated_mm's two halves: (a.values @ b.values^T in the values' dtype, the product of the per-tensor `outer`
    scales in FP32, or the one there is, or None). A fused consumer (nvfp4.NVFP4SwiGLUMLPFn) applies the scale
    itself, as inductor fuses it into the consumer of emulated_mm's result."""
    if a.values.is_cuda:
        with torch.autocast("cuda", enabled=False):
            out = torch.mm(a.values, b.values.t())
    else:
        out = torch.mm(a.values, b.values.t())
    if a.outer is not None and b.outer is not None:
        return out, a.outer * b.outer
    return out, a.outer if a.outer is not None else b.outer


def emulated_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias=None) -> torch.Tensor:
    """a @ b.T (+ bias) on the dequantized operands, in `out_dtype`. The GEMM runs in the values' dtype
    (BF16 in, FP32 accumulation, BF16 out; or FP32); per-tensor `outer` scales and the bias are applied
    to its result in FP32 (see the module docstring for the rounding this implies)."""
    out, scale = emulated_mm_parts(a, b)
    if scale is None and bias is None:
        return in_dtype(out, out_dtype)
    out = in_dtype(out, torch.float32)
    if scale is not None:
        out = out * scale
    if bias is not None:
        out = out + bias.to(torch.float32)
    return in_dtype(out, out_dtype)


def in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as `dtype`, and `t` itself when it already is: under torch 2.11's torch.compile an autograd.Function
    whose forward returns a same-dtype `.to()` of its result gets all-zero input gradients (FP32 runs on CPU;
    fixed by torch 2.13; bench/NOTES_floor.md section 25)."""
    return t if t.dtype == dtype else t.to(dtype)


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling `module` runs hooks (its own or global ones): fused paths that bypass a layer's own forward
    (NVFP4's shared MLP input, fp8_delayed's fused SwiGLU MLP) step aside for them (the numerics probe samples
    layers through forward hooks)."""
    from torch.nn.modules import module as nn_module

    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a plain nn.Linear would return here: the autocast dtype under CUDA autocast."""
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return x.dtype


class EmulatedLinearFn(torch.autograd.Function):
    """Quantize -> dequantize -> GEMM for Fprop, Dgrad and Wgrad, each with its operands' formats."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, quantizer: GemmQuantizer, wf=None, wf_outer=None, wd=None, wd_outer=None):
        """`wf`/`wd` (with their outer scales): W's Fprop and Dgrad operands already quantized (values in this
        GEMM's dtype), from QuantizedLinear's per-step weight cache; None quantizes W here."""
        out_dtype = compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != out_dtype:
            # Under autocast the real kernels (torchao) quantize the autocast (BF16) copy; so do we.
            x2 = x2.to(out_dtype)
        dtype = gemm_dtype(x2, quantizer)
        w_fprop = Quantized(wf, wf_outer) if wf is not None else quantizer.weight_fprop(weight, dtype=dtype)
        y = emulated_mm(quantizer.input(x2, dtype=dtype), w_fprop, out_dtype, bias)
        # High-precision operands are saved and requantized in backward (as torchao does): Wgrad
        # needs X blocked along tokens, a different quantization than Fprop's.
        ctx.save_for_backward(x2, weight, wd, wd_outer)
        ctx.quantizer = quantizer
        ctx.gemm_dtype = dtype
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        x2, weight, wd, wd_outer = ctx.saved_tensors
        q: GemmQuantizer = ctx.quantizer
        dtype = ctx.gemm_dtype
        dy2 = dy.reshape(-1, dy.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            w_dgrad = Quantized(wd, wd_outer) if wd is not None else q.weight_dgrad(weight, dtype=dtype)
            grad_x = emulated_mm(q.grad(dy2, dtype=dtype), w_dgrad, ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            a, b = q.wgrad(dy2, x2, dtype=dtype)
            grad_w = emulated_mm(a, b, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy2.to(torch.float32).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class QuantizedLinear(nn.Linear):
    """nn.Linear whose GEMMs run through a recipe's quantizer. Parameters are the original ones (same
    objects, same names), so optimizers, state dicts and HF checkpoints see an ordinary Linear.

    Quantized-weight reuse (training.precision.weight_reuse): `cached_weight` holds W's quantized operands,
    made once per optimizer step by `refresh_weight_cache()` (outside the compiled graph) and read by every
    micro-batch's forward and backward instead of quantizing W again. A plain attribute, not a buffer: not in
    state dicts, not broadcast by DDP; torch.compile takes it as a graph input. None: W is quantized in the
    forward, as without reuse. Its first element names the path it was made for; a forward on another path
    (e.g. a CPU copy of a GPU-cached module) quantizes W itself."""


    def __init__(self, linear: nn.Linear, quantizer: GemmQuantizer, recipe: str):
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.quantizer = quantizer
        self.recipe = recipe
        self.cached_weight: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return EmulatedLinearFn.apply(x, self.weight, self.bias, self.quantizer, *self._cached("generic"))

    def _apply(self, fn, recurse=True):
        # `.to()`, `.cuda()`, `.bfloat16()`: the cached operands belong to the old weight (the next forward
        # quantizes W itself until the reuse hook refreshes the cache after the next optimizer step).
        self.cached_weight = None
        return super()._apply(fn, recurse)

    def _cached(self, path: str) -> tuple:
        """The cached operands for `path` (see the class docstring), or () to quantize W in the forward."""
        c = self.cached_weight
        return c[1:] if c is not None and c[0] == path else ()

    def reuses_weight_when(self, compiled: bool) -> bool:
        """Whether W may be cached (its quantization a pure function of W) and caching pays here. The torch
        quantizers under torch.compile: no. The compiled forward
        quantizes W inside the layer's graph at no host cost, while a cache would need W quantized by the same
        inductor kernels (eager arithmetic can differ in the last bit) in a compiled call of its own per linear:
        on an H100 that host time cost more than it saved (nvfp4, grad_accum 2: 191.8 against 180.1 ms)."""
        return not compiled

    @torch.no_grad()
    def refresh_weight_cache(self) -> None:
        """Quantize W (eagerly, as the uncompiled forward does) for the generic path and keep it."""
        w = self.weight
        dtype = gemm_dtype(w, self.quantizer)
        f, d = self.quantizer.weight_fprop(w, dtype=dtype), self.quantizer.weight_dgrad(w, dtype=dtype)
        self.cached_weight = ("generic", f.values, f.outer, d.values, d.outer)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, emulated={self.quantizer.describe()}"
