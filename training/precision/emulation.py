"""Exact emulation of quantized training GEMMs, shared by every recipe.

A linear layer Y = X W^T runs three GEMMs. Written as `a @ b.T` with the reduction dimension last in
both operands (the layout every block format scales along):

    Fprop  Y  = X    @ W^T      a = X    [tokens, in],  b = W    [out, in]     reduce over in
    Dgrad  dX = dY   @ W        a = dY   [tokens, out], b = W^T  [in, out]     reduce over out
    Wgrad  dW = dY^T @ X        a = dY^T [out, tokens], b = X^T  [in, tokens]  reduce over tokens

A `GemmQuantizer` says how each operand is quantized; `EmulatedLinearFn` quantizes, dequantizes
(exactly, see formats.py) and multiplies. On GPU the GEMM runs in BF16 with FP32 accumulation (the
dequantized values are exact in BF16); per-tensor scales multiply the FP32 result, as the real
block-scaled kernels do. On CPU it runs in FP32 math.
"""
from __future__ import annotations

import torch
from torch import nn

from training.precision.formats import Quantized

# torch >= 2.8 has mm(..., out_dtype=float32) for BF16 inputs on CUDA: FP32 accumulation, FP32 result.
_MM_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


class GemmQuantizer:
    """How a recipe quantizes the operands of the three GEMMs. Subclasses override the four methods;
    `track=True` asks for saturation counts (numerics telemetry only)."""

    def input(self, x2d: torch.Tensor, *, track: bool = False) -> Quantized:
        raise NotImplementedError

    def weight(self, w: torch.Tensor, *, track: bool = False) -> tuple[Quantized, Quantized]:
        """(Fprop operand W [out, in], Dgrad operand W^T [in, out])."""
        raise NotImplementedError

    # The GEMMs ask for one orientation at a time so a step quantizes W once per GEMM, not twice.
    def weight_fprop(self, w: torch.Tensor) -> Quantized:
        return self.weight(w)[0]

    def weight_dgrad(self, w: torch.Tensor) -> Quantized:
        return self.weight(w)[1]

    def grad(self, dy2d: torch.Tensor, *, track: bool = False) -> Quantized:
        raise NotImplementedError

    def wgrad(self, dy_t: torch.Tensor, x_t: torch.Tensor) -> tuple[Quantized, Quantized]:
        """Operands of the Wgrad GEMM, both [*, tokens], reduced over tokens."""
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


def _bf16_mm_fp32_out(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """BF16 x BF16 GEMM with FP32 accumulation; FP32 output where the build has it (so per-tensor scales
    multiply the accumulator before the one rounding, as in the real kernels), else BF16 output."""
    if _MM_HAS_OUT_DTYPE:
        return torch.mm(a, b_t, out_dtype=torch.float32)
    return torch.mm(a, b_t).float()


def emulated_mm(a: Quantized, b: Quantized) -> torch.Tensor:
    """a @ b.T on dequantized operands, FP32 result."""
    if a.values.is_cuda:
        with torch.autocast("cuda", enabled=False):
            if a.bf16_exact and b.bf16_exact:
                out = _bf16_mm_fp32_out(a.values.to(torch.bfloat16), b.values.to(torch.bfloat16).t())
            else:
                # FP32 block scales (fp8_blockwise) are not exact in BF16: keep the GEMM in FP32, no TF32.
                out = torch.mm(a.values, b.values.t())
    else:
        out = torch.mm(a.values, b.values.t())
    if a.outer is not None and b.outer is not None:
        out = out * (a.outer * b.outer)
    elif a.outer is not None:
        out = out * a.outer
    elif b.outer is not None:
        out = out * b.outer
    return out


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a plain nn.Linear would return here: the autocast dtype under CUDA autocast."""
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return x.dtype


class EmulatedLinearFn(torch.autograd.Function):
    """Quantize -> dequantize -> GEMM for Fprop, Dgrad and Wgrad, each with its operands' formats."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, quantizer: GemmQuantizer):
        out_dtype = compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        if x.is_cuda and torch.is_autocast_enabled("cuda"):
            # The real kernels (torchao) quantize the autocast (BF16) copy of the activation; so do we.
            x2 = x2.to(out_dtype)
        y = emulated_mm(quantizer.input(x2), quantizer.weight_fprop(weight))
        if bias is not None:
            y = y + bias.to(torch.float32)
        # High-precision operands are saved and requantized in backward (as torchao does): Wgrad
        # needs X blocked along tokens, a different quantization than Fprop's.
        ctx.save_for_backward(x2, weight)
        ctx.quantizer = quantizer
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        q: GemmQuantizer = ctx.quantizer
        dy2 = dy.reshape(-1, dy.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = emulated_mm(q.grad(dy2), q.weight_dgrad(weight)).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            a, b = q.wgrad(dy2.t(), x2.t())
            grad_w = emulated_mm(a, b).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy2.to(torch.float32).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


class QuantizedLinear(nn.Linear):
    """nn.Linear whose GEMMs run through a recipe's quantizer. Parameters are the original ones (same
    objects, same names), so optimizers, state dicts and HF checkpoints see an ordinary Linear."""

    def __init__(self, linear: nn.Linear, quantizer: GemmQuantizer, recipe: str):
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.quantizer = quantizer
        self.recipe = recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return EmulatedLinearFn.apply(x, self.weight, self.bias, self.quantizer)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, emulated={self.quantizer.describe()}"
