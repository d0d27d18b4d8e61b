"""`fp8_rowwise`: FP8 E4M3 for every operand, one power-of-two scale per row of each GEMM operand
(along the reduction dimension), as torchao's `rowwise` recipe. Real kernels: torchao `Float8Linear`
with row-wise `torch._scaled_mm`, sm_89+ (fast on sm_90+)."""
from __future__ import annotations

import torch

from training.precision.emulation import GemmQuantizer
from training.precision.formats import quantize_fp8_blocks
from training.precision.fp8_tensorwise import TorchaoFloat8Recipe
from training.precision.registry import register

E4M3 = torch.float8_e4m3fn


def _rows(t, *, axis=-1, dtype=torch.float32, track=False):
    """One power-of-two scale per row (axis -1) or per column (axis 0)."""
    return quantize_fp8_blocks(t, None, E4M3, power_of_2=True, axis=axis, dtype=dtype, track=track)


class RowwiseQuantizer(GemmQuantizer):
    def input(self, x2d, *, dtype=torch.float32, track=False):
        return _rows(x2d, dtype=dtype, track=track)

    def weight_fprop(self, w, *, dtype=torch.float32, track=False):
        return _rows(w, dtype=dtype, track=track)

    def weight_dgrad(self, w, *, dtype=torch.float32, track=False):
        # Dgrad reduces over out_features, so W is re-scaled along its columns for it.
        return _rows(w, axis=0, dtype=dtype, track=track).t()

    def grad(self, dy2d, *, dtype=torch.float32, track=False):
        return _rows(dy2d, dtype=dtype, track=track)

    def grad_wgrad(self, dy2d, *, dtype=torch.float32):
        return _rows(dy2d, axis=0, dtype=dtype).t()

    def input_wgrad(self, x2d, *, dtype=torch.float32):
        return _rows(x2d, axis=0, dtype=dtype).t()

    def describe(self):
        return "E4M3 all operands, power-of-two scale per row along the reduction dim"


@register
class FP8RowwiseRecipe(TorchaoFloat8Recipe):
    name = "fp8_rowwise"
    torchao_recipe = "rowwise"
    quantizer_cls = RowwiseQuantizer
    gemm_error_bound = 0.08  # E4M3 with per-row scales ≈ 0.04
