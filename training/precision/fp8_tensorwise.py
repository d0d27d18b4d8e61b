"""`fp8_tensorwise`: FP8 with per-tensor *current* scaling ("FP8-CS"; torchao `tensorwise`).

X and W in E4M3, dY in E5M2 (gradients need range more than precision); each tensor's scale is
448 (or 57344) / its current amax. Real kernels: torchao `Float8Linear` (`torch._scaled_mm`), sm_89+.
"""
from __future__ import annotations

import torch

from training.precision.emulation import GemmQuantizer, QuantizedLinear
from training.precision.formats import quantize_fp8_tensorwise
from training.precision.registry import Recipe, capability_reason, register

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class TensorwiseQuantizer(GemmQuantizer):
    # Per-tensor quantization is transpose-invariant: every orientation is a view of one quantization.
    def input(self, x2d, *, dtype=torch.float32, track=False):
        return quantize_fp8_tensorwise(x2d, E4M3, dtype=dtype, track=track)

    def weight_fprop(self, w, *, dtype=torch.float32, track=False):
        return quantize_fp8_tensorwise(w, E4M3, dtype=dtype, track=track)

    def weight_dgrad(self, w, *, dtype=torch.float32, track=False):
        return quantize_fp8_tensorwise(w, E4M3, dtype=dtype, track=track).t()

    def grad(self, dy2d, *, dtype=torch.float32, track=False):
        return quantize_fp8_tensorwise(dy2d, E5M2, dtype=dtype, track=track)

    def wgrad(self, dy2d, x2d, *, dtype=torch.float32):
        return (quantize_fp8_tensorwise(dy2d, E5M2, dtype=dtype).t(),
                quantize_fp8_tensorwise(x2d, E4M3, dtype=dtype).t())

    def describe(self):
        return "E4M3 X/W, E5M2 dY, per-tensor current scaling"


def torchao_float8_linear(linear, recipe_name: str):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear.from_float(linear, config=Float8LinearConfig.from_recipe_name(recipe_name))


def scaled_mm_shape_reason(linear, recipe: str):
    # torch._scaled_mm needs every GEMM dimension divisible by 16.
    for what, dim in (("in_features", linear.in_features), ("out_features", linear.out_features)):
        if dim % 16:
            return f"{what} {dim} not a multiple of 16 required by FP8 tensor cores ({recipe})"
    return None


class TorchaoFloat8Recipe(Recipe):
    """A per-tensor or per-row FP8 recipe: torchao `Float8Linear` where FP8 tensor cores exist, our exact
    emulation with `quantizer_cls` elsewhere."""
    torchao_recipe = ""
    quantizer_cls: type[GemmQuantizer] = GemmQuantizer

    def real_unavailable(self, device, options):
        return capability_reason(device, self.min_capability, "FP8 tensor cores")

    def skip_reason(self, linear, real):
        return scaled_mm_shape_reason(linear, self.name) if real else None

    def convert(self, linear, name, options, real):
        quantizer = self.quantizer_cls()
        if real:
            return (torchao_float8_linear(linear, self.torchao_recipe), quantizer,
                    f"torchao Float8Linear ({self.torchao_recipe})")
        return QuantizedLinear(linear, quantizer, self.name), quantizer, f"emulated: {quantizer.describe()}"


@register
class FP8TensorwiseRecipe(TorchaoFloat8Recipe):
    name = "fp8_tensorwise"
    torchao_recipe = "tensorwise"
    quantizer_cls = TensorwiseQuantizer
