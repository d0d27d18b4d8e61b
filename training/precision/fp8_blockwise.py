"""`fp8_blockwise`: DeepSeek-V3 style sub-channel FP8. E4M3 everywhere; activations and gradients get
one FP32 scale per 1x128 run along the GEMM's reduction dim, weights one per 128x128 tile (so Fprop and
Dgrad share the weight quantization). Real kernels: torchao prototype `fp8_blockwise_mm`, sm_90+,
needs in/out features (and tokens per step) divisible by 128 and no bias."""
from __future__ import annotations

import torch
from torch import nn

from training.precision.emulation import EmulatedLinearFn, GemmQuantizer
from training.precision.formats import quantize_fp8_blocks
from training.precision.registry import Recipe, capability_reason, register

E4M3 = torch.float8_e4m3fn
BLOCK = 128
# PLAB_BLOCKWISE_AUTOTUNE=quick: torchao's blockwise activation quantizers autotune over 45 launch configs
# each (NUM_GROUPS x warps x stages), minutes of compiling at a model's first step; "quick" keeps the 8 with
# NUM_GROUPS in (16, 64), 4 or 8 warps, 2 or 4 stages. The GEMM kernels keep all their configs. For
# benchmarks that must fit a time budget (bench/train_bench.py sets it and says so in its results).
QUICK_GROUPS, QUICK_WARPS, QUICK_STAGES = (16, 64), (4, 8), (2, 4)


def apply_autotune_policy() -> int | None:
    """Prune torchao's quantizer autotuning per PLAB_BLOCKWISE_AUTOTUNE; returns the configs kept per kernel."""
    import os

    if os.environ.get("PLAB_BLOCKWISE_AUTOTUNE", "full") != "quick":
        return None
    from torchao.prototype.blockwise_fp8_training import kernels
    from triton.runtime.autotuner import Autotuner

    kept = None
    for name in dir(kernels):
        tuner = getattr(kernels, name)
        if not isinstance(tuner, Autotuner) or not any("NUM_GROUPS" in c.kwargs for c in tuner.configs):
            continue
        quick = [c for c in tuner.configs if c.kwargs.get("NUM_GROUPS") in QUICK_GROUPS
                 and c.num_warps in QUICK_WARPS and c.num_stages in QUICK_STAGES]
        if quick:
            tuner.configs = quick
            kept = len(quick)
    return kept


def _runs(t, *, axis=-1, track=False):
    return quantize_fp8_blocks(t, BLOCK, E4M3, axis=axis, track=track)


def _tiles(w, *, track=False):
    return quantize_fp8_blocks(w, BLOCK, E4M3, block_2d=True, track=track)


class BlockwiseQuantizer(GemmQuantizer):
    # FP32 scales per block are not exact in BF16: the emulated GEMMs stay FP32 (`dtype` is ignored).
    bf16_exact = False

    def input(self, x2d, *, dtype=torch.float32, track=False):
        return _runs(x2d, track=track)

    def weight_fprop(self, w, *, dtype=torch.float32, track=False):
        return _tiles(w, track=track)

    def weight_dgrad(self, w, *, dtype=torch.float32, track=False):
        return _tiles(w, track=track).t()  # 128x128 tiles are transpose-invariant

    def grad(self, dy2d, *, dtype=torch.float32, track=False):
        return _runs(dy2d, track=track)

    def wgrad(self, dy2d, x2d, *, dtype=torch.float32):
        return _runs(dy2d, axis=0).t(), _runs(x2d, axis=0).t()

    def describe(self):
        return "E4M3, 1x128 activation/gradient scales, 128x128 weight tiles"


class BlockwiseFP8Linear(nn.Linear):
    """Real-kernel layer: torchao's blockwise FP8 autograd function. Steps whose token count is not a
    multiple of 128 (the Wgrad block runs over tokens) fall back to the exact emulation."""

    def __init__(self, linear: nn.Linear, quantizer: GemmQuantizer):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.quantizer = quantizer

    def forward(self, x):
        tokens = x.numel() // x.shape[-1]
        if not x.is_cuda or tokens % BLOCK:
            return EmulatedLinearFn.apply(x, self.weight, self.bias, self.quantizer)
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        # torchao's kernels are written for BF16 inputs (Float8BlockwiseLinear.supported_dtypes).
        return fp8_blockwise_mm.apply(x.to(torch.bfloat16).contiguous(), self.weight.to(torch.bfloat16),
                                      BLOCK, torch.bfloat16, False)


@register
class FP8BlockwiseRecipe(Recipe):
    name = "fp8_blockwise"

    def real_unavailable(self, device, options):
        reason = capability_reason(device, self.min_capability, "torchao blockwise FP8 kernels")
        if reason is None:
            try:
                import torchao.prototype.blockwise_fp8_training.linear  # noqa: F401
            except Exception as exc:  # an import failure is a reason, not a crash
                return f"torchao blockwise FP8 prototype failed to import: {exc}"
        return reason

    def skip_reason(self, linear, real):
        for what, dim in (("in_features", linear.in_features), ("out_features", linear.out_features)):
            if dim % BLOCK:
                return f"{what} {dim} not a multiple of {BLOCK} required by fp8_blockwise"
        if real and linear.bias is not None:
            return "torchao blockwise FP8 kernels do not support a bias"
        return None

    def convert(self, linear, name, options, real):
        quantizer = BlockwiseQuantizer()
        if real:
            apply_autotune_policy()
            return BlockwiseFP8Linear(linear, quantizer), quantizer, "torchao fp8_blockwise_mm (1x128 / 128x128)"
        from training.precision.emulation import QuantizedLinear

        return QuantizedLinear(linear, quantizer, self.name), quantizer, f"emulated: {quantizer.describe()}"
