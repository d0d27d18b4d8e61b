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


def _rows(t, track=False):
    return quantize_fp8_blocks(t, None, E4M3, power_of_2=True, track=track)


class RowwiseQuantizer(GemmQuantizer):
    def input(self, x2d, *, track=False):
        return _rows(x2d, track)

    def weight(self, w, *, track=False):
        # Dgrad reduces over out_features, so W is re-scaled along its columns for it.
        return _rows(w, track), _rows(w.t())

    def weight_fprop(self, w):
        return _rows(w)

    def weight_dgrad(self, w):
        return _rows(w.t())

    def grad(self, dy2d, *, track=False):
        return _rows(dy2d, track)

    def wgrad(self, dy_t, x_t):
        return _rows(dy_t), _rows(x_t)

    def describe(self):
        return "E4M3 all operands, power-of-two scale per row along the reduction dim"


@register
class FP8RowwiseRecipe(TorchaoFloat8Recipe):
    name = "fp8_rowwise"
    summary = "E4M3 everywhere; power-of-two scale per row/column along each GEMM's reduction dim"
    gpu_requirement = "real FP8 GEMMs on sm_89+ via torchao Float8Linear (rowwise); emulated elsewhere"
    torchao_recipe = "rowwise"
    quantizer_cls = RowwiseQuantizer
