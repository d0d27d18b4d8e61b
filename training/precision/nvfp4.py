"""`nvfp4`: NVIDIA's NVFP4 training recipe (arXiv 2509.25149).

E2M1 elements; one E4M3 scale per 16 elements plus one FP32 scale per tensor. Activations and
gradients use 1x16 blocks along the GEMM's reduction dim; weights use 16x16 tiles (`weight_2d`), so
Fprop and Dgrad see the same quantized weight (the chain rule stays consistent). Both Wgrad operands
pass through a 16-point random Hadamard transform along the token dim (`rht`: one fixed random sign
vector, seeded by `rht_seed`), which spreads outliers before FP4 quantization and cancels in the
product. Gradients are stochastically rounded (`stochastic_rounding`) so their quantization is
unbiased. Each part can be switched off for ablations. Real kernels: torchao `NVFP4Linear`, sm_100+
only and only with every part on; exact emulation elsewhere (E2M1 x E4M3 is exact in BF16, the FP32
tensor scales multiply the FP32 GEMM output).
"""
from __future__ import annotations

import torch

from training.precision.emulation import GemmQuantizer, QuantizedLinear
from training.precision.formats import quantize_nvfp4, random_hadamard_transform, random_sign_vector, rht_matrix
from training.precision.fp8_tensorwise import transposed
from training.precision.registry import Recipe, capability_reason, register

BLOCK = 16


class NVFP4Quantizer(GemmQuantizer):
    def __init__(self, *, rht: bool, stochastic_rounding: bool, weight_2d: bool, rht_seed: int, device=None):
        self.rht = rht
        self.stochastic_rounding = stochastic_rounding
        self.weight_2d = weight_2d
        self.signs = random_sign_vector(rht_seed)
        # Built once on the layer's device: no per-step host work, nothing for torch.compile to trace.
        self.rht_matrix = rht_matrix(self.signs).to(device) if device is not None else rht_matrix(self.signs)

    def input(self, x2d, *, track=False):
        return quantize_nvfp4(x2d, track=track)

    def weight(self, w, *, track=False):
        if self.weight_2d:
            q = quantize_nvfp4(w, block_2d=True, track=track)
            return q, transposed(q)
        return quantize_nvfp4(w, track=track), quantize_nvfp4(w.t())

    def weight_fprop(self, w):
        return quantize_nvfp4(w, block_2d=self.weight_2d)

    def weight_dgrad(self, w):
        return transposed(quantize_nvfp4(w, block_2d=True)) if self.weight_2d else quantize_nvfp4(w.t())

    def grad(self, dy2d, *, track=False):
        return quantize_nvfp4(dy2d, stochastic=self.stochastic_rounding, track=track)

    def wgrad(self, dy_t, x_t):
        if self.rht:
            dy_t = random_hadamard_transform(dy_t, self.rht_matrix)
            x_t = random_hadamard_transform(x_t, self.rht_matrix)
        return quantize_nvfp4(dy_t, stochastic=self.stochastic_rounding), quantize_nvfp4(x_t)

    def describe(self):
        parts = ["16x16 weights" if self.weight_2d else "1x16 weights"]
        parts.append("RHT on Wgrad" if self.rht else "no RHT")
        parts.append("SR on grads" if self.stochastic_rounding else "RNE grads")
        return "NVFP4 E2M1 + E4M3/16 + FP32 tensor scale, " + ", ".join(parts)


@register
class NVFP4Recipe(Recipe):
    name = "nvfp4"
    summary = ("E2M1 + E4M3 scale per 16 + FP32 tensor scale; 16x16 weight tiles, 16-point RHT on Wgrad "
               "inputs, stochastic rounding of gradients")
    gpu_requirement = "real NVFP4 GEMMs on sm_100+ (Blackwell) via torchao NVFP4Linear; exact emulation on Hopper/CPU"
    options = {"rht": True, "stochastic_rounding": True, "weight_2d": True, "rht_seed": 0}

    def validate_options(self, options):
        seed = options["rht_seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"option rht_seed of nvfp4 must be a non-negative integer, got {seed!r}")

    def real_unavailable(self, device, options):
        reason = capability_reason(device, (10, 0), "NVFP4 tensor cores")
        if reason is None and not (options["rht"] and options["stochastic_rounding"] and options["weight_2d"]):
            return "torchao's NVFP4 kernels always apply RHT, stochastic rounding and 2D weights; ablations are emulated"
        if reason is None:
            try:
                from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear  # noqa: F401
            except Exception as exc:
                return f"torchao NVFP4Linear failed to import: {exc}"
        return reason

    def skip_reason(self, linear, real):
        for what, dim in (("in_features", linear.in_features), ("out_features", linear.out_features)):
            if dim % BLOCK:
                return f"{what} {dim} not a multiple of {BLOCK} required by nvfp4"
        return None

    def convert(self, linear, name, options, real):
        quantizer = NVFP4Quantizer(rht=options["rht"], stochastic_rounding=options["stochastic_rounding"],
                                   weight_2d=options["weight_2d"], rht_seed=options["rht_seed"],
                                   device=linear.weight.device)
        if real:
            from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear

            signs = tuple(int(s) for s in quantizer.signs.tolist())
            return (NVFP4Linear.from_linear(linear, rht_sign_vector=signs), quantizer,
                    "torchao NVFP4Linear (RHT, SR, 2D weights)")
        return QuantizedLinear(linear, quantizer, self.name), quantizer, f"emulated: {quantizer.describe()}"
