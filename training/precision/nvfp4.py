"""`nvfp4`: NVIDIA's NVFP4 training recipe (arXiv 2509.25149).

E2M1 elements; one E4M3 scale per 16 elements plus one FP32 scale per tensor. Activations and
gradients use 1x16 blocks along the GEMM's reduction dim; weights use 16x16 tiles (`weight_2d`), so
Fprop and Dgrad see the same quantized weight (the chain rule stays consistent). Both Wgrad operands
pass through a 16-point random Hadamard transform along the token dim (`rht`: one fixed random sign
vector, seeded by `rht_seed`), which spreads outliers before FP4 quantization and cancels in the
product. Gradients are stochastically rounded (`stochastic_rounding`) so their quantization is
unbiased. Each part can be switched off for ablations. Real kernels: torchao `NVFP4Linear`, sm_100+
only and only with every part on; emulation elsewhere.

Emulation (see emulation.py): each operand is quantized and dequantized to element x E4M3 block scale,
which is exact in BF16; on GPU that BF16 tensor feeds a plain BF16 GEMM (FP32 accumulation, BF16
result) and the FP32 per-tensor scales of both operands are then multiplied onto the BF16 result and
rounded again: accumulator -> BF16 -> x global scales -> BF16. This double rounding (one extra BF16
rounding, 2^-9 relative) is the one place where the emulation is not bit-exact with a block-scaled
kernel that applies the global scale to its FP32 accumulator; it is far below FP4's own error. The
other one is the RHT on GPU: a BF16 GEMM (exact products, FP32 accumulation) whose result is rounded to
BF16 before the FP4 quantization reads it (2^-9 relative, against FP4 steps of 17-33%), where a fused
hardware kernel would quantize the FP32 sums; an FP32 result would double the memory traffic of the
Wgrad quantizers. On CPU every GEMM, the RHT included, is FP32 with a single rounding. The Wgrad
operands are blocked along tokens in place (no transposed copies), and stochastic rounding draws with
`torch.rand_like` (in-kernel Philox under torch.compile; eager and compiled runs therefore draw
different, equally distributed, roundings).
"""
from __future__ import annotations

import torch

from training.precision.emulation import GemmQuantizer, QuantizedLinear
from training.precision.formats import quantize_nvfp4, random_hadamard_transform, random_sign_vector, rht_matrix
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

    def input(self, x2d, *, dtype=torch.float32, track=False):
        return quantize_nvfp4(x2d, dtype=dtype, track=track)

    def weight_fprop(self, w, *, dtype=torch.float32, track=False):
        return quantize_nvfp4(w, block_2d=self.weight_2d, dtype=dtype, track=track)

    def weight_dgrad(self, w, *, dtype=torch.float32, track=False):
        # 16x16 tiles are transpose-invariant: Dgrad sees the very weight Fprop saw. With 1x16 blocks,
        # W is re-blocked along out_features (its columns, in place, used transposed).
        if self.weight_2d:
            return quantize_nvfp4(w, block_2d=True, dtype=dtype, track=track).t()
        return quantize_nvfp4(w, axis=0, dtype=dtype, track=track).t()

    def grad(self, dy2d, *, dtype=torch.float32, track=False):
        return quantize_nvfp4(dy2d, stochastic=self.stochastic_rounding, dtype=dtype, track=track)

    def wgrad(self, dy2d, x2d, *, dtype=torch.float32):
        # Both operands blocked along tokens (axis 0 of [tokens, features]); the RHT mixes each run of 16
        # tokens in place, as a GEMM in the GEMM dtype (BF16 on GPU: exact products, FP32 accumulation).
        if self.rht:
            m = self.rht_matrix.to(dy2d.device)
            dy2d = random_hadamard_transform(dy2d, m, axis=0, dtype=dtype)
            x2d = random_hadamard_transform(x2d, m, axis=0, dtype=dtype)
        return (quantize_nvfp4(dy2d, axis=0, stochastic=self.stochastic_rounding, dtype=dtype).t(),
                quantize_nvfp4(x2d, axis=0, dtype=dtype).t())

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
