"""`mxfp8`: OCP Microscaling FP8. E4M3 elements with one E8M0 (power-of-two) scale per 32 elements
along each GEMM's reduction dim, for X, W and dY alike (W is re-blocked along out_features for Dgrad,
X and dY along tokens for Wgrad). Scale rule option `scale_rounding`: "rceil" (default, the
cuBLAS/Blackwell rule) or "floor" (OCP spec). Real kernels: torchao `MXFP8Linear`, sm_100+ only;
on Hopper and CPU exact emulation: E4M3 x 2^k is exact in BF16, so on GPU the quantizer writes the
dequantized operand in BF16 and a plain BF16 GEMM (FP32 accumulation) gives the block-scaled product
with a single rounding of the result. W for Dgrad and X, dY for Wgrad are blocked along their rows in
place and used as transposed views.

GEMM benchmark (`gemm_ops`): on sm_100+ torchao's `MXTensor.to_mx` and block-scaled GEMM in both modes; elsewhere
kernel-only mode times torchao's emulated path (MXTensor dequantized to BF16, BF16 GEMM) and the "with
quantization" mode this module's training quantizer and training's emulated GEMM.

On CUDA with BF16 activations and weights the layer takes the fused path (option `fused_quantize`, on by
default; mxfp8_triton.py): X, W and dY are each quantized into both their layouts by one Triton pass,
bit-identical with the torch quantizers, so the training is the same."""
from __future__ import annotations

import torch

from training.precision.emulation import EmulatedLinearFn, GemmQuantizer, QuantizedLinear, compute_dtype
from training.precision.formats import quantize_mxfp8
from training.precision.gemm_ops import EmulatedTorchaoOps, TorchaoBlockScaled, TorchaoBlockScaledOps, has_capability
from training.precision.registry import Recipe, capability_reason, register

BLOCK = 32


class MXFP8Quantizer(GemmQuantizer):
    def __init__(self, scale_rounding: str, fused: bool = True):
        self.scale_rounding = scale_rounding
        self.fused = fused  # the Triton fast path on CUDA (mxfp8_triton.py); False: torch quantizers only

    def _q(self, t, *, axis=-1, dtype=torch.float32, track=False):
        return quantize_mxfp8(t, block_size=BLOCK, scale_rounding=self.scale_rounding, axis=axis, dtype=dtype,
                              track=track)

    def input(self, x2d, *, dtype=torch.float32, track=False):
        return self._q(x2d, dtype=dtype, track=track)

    def weight_fprop(self, w, *, dtype=torch.float32, track=False):
        return self._q(w, dtype=dtype, track=track)

    def weight_dgrad(self, w, *, dtype=torch.float32, track=False):
        # Blocks along out_features: W's columns, quantized in place and used transposed.
        return self._q(w, axis=0, dtype=dtype, track=track).t()

    def grad(self, dy2d, *, dtype=torch.float32, track=False):
        return self._q(dy2d, dtype=dtype, track=track)

    def grad_wgrad(self, dy2d, *, dtype=torch.float32):
        return self._q(dy2d, axis=0, dtype=dtype).t()

    def input_wgrad(self, x2d, *, dtype=torch.float32):
        return self._q(x2d, axis=0, dtype=dtype).t()

    def describe(self):
        return f"MXFP8 E4M3, E8M0 scale per 1x{BLOCK} along the reduction dim ({self.scale_rounding})"


def torchao_mxfp8(scale_rounding: str, real: bool) -> TorchaoBlockScaled:
    """torchao's MXFP8 operands (`MXTensor.to_mx`, E4M3, 32-element blocks) and GEMM for the GEMM benchmark."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    mode = ScaleCalculationMode.RCEIL if scale_rounding == "rceil" else ScaleCalculationMode.FLOOR
    kwargs = {}
    dispatch = None
    if real:
        from torchao.prototype.mx_formats.mx_tensor import _addmm_mx_dispatch as dispatch
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
        kwargs["kernel_preference"] = KernelPreference.AUTO
    return TorchaoBlockScaled("MXTensor.to_mx", BLOCK,
                              lambda x: MXTensor.to_mx(x, torch.float8_e4m3fn, BLOCK, scaling_mode=mode, **kwargs),
                              dispatch)


class MXFP8EmulatedLinear(QuantizedLinear):
    """Emulated MXFP8 linear: the fused Triton quantizers on CUDA with BF16 activations and weights, the torch
    quantizers of EmulatedLinearFn elsewhere."""
    # training.perf.rope_backward auto: the one-pass RoPE backward keeps this layer's values (training.rope_triton)
    rope_one_pass_auto = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and compute_dtype(x) == torch.bfloat16 and self._fused_weight():
            from training.precision import mxfp8_triton

            return mxfp8_triton.MXFP8FusedFn.apply(x, self.weight, self.bias, self.quantizer.scale_rounding,
                                                   *self._cached("fused"))
        return EmulatedLinearFn.apply(x, self.weight, self.bias, self.quantizer, *self._cached("generic"))

    def _fused_weight(self) -> bool:
        """Whether a BF16 activation takes the fused Triton path with this weight."""
        if not (self.weight.is_cuda and self.weight.dtype == torch.bfloat16 and self.quantizer.fused):
            return False
        from training.precision import mxfp8_triton
        return mxfp8_triton.HAVE_TRITON

    def reuses_weight_when(self, compiled: bool) -> bool:
        # The fused path's weight quantizer is one Triton kernel, the same in and out of a compiled graph.
        return self._fused_weight() or super().reuses_weight_when(compiled)

    @torch.no_grad()
    def refresh_weight_cache(self) -> None:
        if not self._fused_weight():
            return super().refresh_weight_cache()
        from training.precision.mxfp8_triton import mxfp8_dual_quantize
        self.cached_weight = ("fused", *mxfp8_dual_quantize(self.weight, self.quantizer.scale_rounding))


@register
class MXFP8Recipe(Recipe):
    name = "mxfp8"
    gemm_error_bound = 0.08  # E4M3 with block scales ≈ 0.04

    def real_unavailable(self, device, options):
        reason = capability_reason(device, self.min_capability, "MXFP8 tensor cores")
        if reason is None:
            try:
                from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear  # noqa: F401
            except Exception as exc:
                return f"torchao MXFP8Linear failed to import: {exc}"
        return reason

    def skip_reason(self, linear, real):
        for what, dim in (("in_features", linear.in_features), ("out_features", linear.out_features)):
            if dim % BLOCK:
                return f"{what} {dim} not a multiple of {BLOCK} required by mxfp8"
        return None

    def convert(self, linear, name, options, real):
        quantizer = MXFP8Quantizer(options["scale_rounding"], fused=options.get("fused_quantize", True))
        if real:
            from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

            mode = ScaleCalculationMode.RCEIL if options["scale_rounding"] == "rceil" else ScaleCalculationMode.FLOOR
            with torch.device("meta"):
                new = MXFP8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  kernel_preference=KernelPreference.AUTO, scale_calculation_mode=mode)
            new.weight, new.bias = linear.weight, linear.bias
            return new, quantizer, f"torchao MXFP8Linear ({options['scale_rounding']})"
        fused = " (fused Triton quantizers on CUDA)" if quantizer.fused else ""
        return (MXFP8EmulatedLinear(linear, quantizer, self.name), quantizer,
                f"emulated: {quantizer.describe()}{fused}")

    def gemm_ops(self, device):
        rounding = self.resolve_options({})["scale_rounding"]
        real = has_capability(device, self.min_capability)
        torchao = torchao_mxfp8(rounding, real)
        if real:
            return TorchaoBlockScaledOps(self.name, device, self.gemm_error_bound, torchao)
        # X, W and dY quantize alike (1x32 blocks along the GEMM's reduction dim): one quantizer, one timing.
        return EmulatedTorchaoOps(self.name, device, self.gemm_error_bound, MXFP8Quantizer(rounding), torchao,
                                  role_independent=True)
