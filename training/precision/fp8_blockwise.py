"""`fp8_blockwise`: DeepSeek-V3 style sub-channel FP8. E4M3 everywhere; activations and gradients get
one FP32 scale per 1x128 run along the GEMM's reduction dim, weights one per 128x128 tile (so Fprop and
Dgrad share the weight quantization). Real kernels: those of torchao prototype `fp8_blockwise_mm`, sm_90+, run by
`TracedBlockwiseFn` so that they stay in the compiled graph (option `traced_gemm`); needs in/out features (and
tokens per step) divisible by 128 and no bias.

GEMM benchmark: on SM90+ torchao's six Triton quantizers of `fp8_blockwise_mm` and its cuBLAS blockwise GEMM,
or its Triton GEMM where cuBLAS lacks blockwise scaling (`BlockwiseGemmOps`); elsewhere emulated
(`BlockwiseEmulatedGemmOps`)."""
from __future__ import annotations

import torch
from torch import nn

from training.precision.emulation import EmulatedLinearFn, GemmQuantizer
from training.precision.formats import quantize_dequantize, quantize_fp8_blocks
from training.precision.gemm_ops import (EmulatedGemmOps, GemmOps, check_divisible, check_pass, check_role,
                                         has_capability)
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

    def grad_wgrad(self, dy2d, *, dtype=torch.float32):
        return _runs(dy2d, axis=0).t()

    def input_wgrad(self, x2d, *, dtype=torch.float32):
        return _runs(x2d, axis=0).t()

    def describe(self):
        return "E4M3, 1x128 activation/gradient scales, 128x128 weight tiles"


def _blockwise_gemm(a, a_scale, b, b_scale, recipe_b):
    """torchao's cuBLAS blockwise GEMM through its custom op `torchao::blockwise_scaled_mm`: the same
    `_scaled_mm_v2` call (with the same rhs-scale preparation) as `F.scaled_mm` makes in torchao's
    fp8_blockwise_mm, but one opaque op to torch.compile, where the `F.scaled_mm` call is Python it runs."""
    from torchao.prototype.blockwise_fp8_training import kernels as bk

    return torch.ops.torchao.blockwise_scaled_mm(a, b, a_scale, bk._scaling_type_value(
        bk.BLOCKWISE_1X128_SCALING_TYPE), b_scale, bk._scaling_type_value(recipe_b), torch.bfloat16)


class TracedBlockwiseFn(torch.autograd.Function):
    """torchao's `fp8_blockwise_mm` (1x128 X / dY, 128x128 W, cuBLAS blockwise GEMM), kernel for kernel, with
    its GEMMs through `_blockwise_gemm`. torchao's own function calls `F.scaled_mm` in Python, which the
    compiler does not put in its graph: each layer's linears then ran eagerly, ~300 custom-op dispatches per
    1b step from Python (bench/results/host_profile_2026-11-24T2200_*: the step host-bound, 298 ms of host time
    against ~107 ms of GPU work). Here every quantizer is a torchao `triton_op` the compiler launches itself."""

    @staticmethod
    def forward(ctx, x, weight):
        from torchao.prototype.blockwise_fp8_training import kernels as bk

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        x_fp8, x_scale = bk.triton_fp8_blockwise_act_quant_lhs(x2, BLOCK)
        w_t_fp8, w_t_scale = bk.triton_fp8_blockwise_weight_quant_transposed_rhs(weight, block_size=BLOCK)
        out = _blockwise_gemm(x_fp8, x_scale, w_t_fp8, w_t_scale, bk.BLOCKWISE_128X128_SCALING_TYPE)
        ctx.save_for_backward(x2, weight)
        ctx.shape = shape
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        from torchao.prototype.blockwise_fp8_training import kernels as bk

        x2, weight = ctx.saved_tensors
        dy = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        dy_fp8, dy_scale = bk.triton_fp8_blockwise_act_quant_lhs(dy, BLOCK)
        w_fp8, w_scale = bk.triton_fp8_blockwise_weight_quant_rhs(weight, block_size=BLOCK)
        grad_x = _blockwise_gemm(dy_fp8, dy_scale, w_fp8, w_scale, bk.BLOCKWISE_128X128_SCALING_TYPE)
        dy_t_fp8, dy_t_scale = bk.triton_fp8_blockwise_act_quant_transposed_lhs(dy, BLOCK)
        x_fp8, x_scale = bk.triton_fp8_blockwise_act_quant_rhs(x2, BLOCK)
        grad_w = _blockwise_gemm(dy_t_fp8, dy_t_scale, x_fp8, x_scale.transpose(-1, -2),
                                 bk.BLOCKWISE_1X128_SCALING_TYPE)
        return grad_x.reshape(ctx.shape), grad_w


class BlockwiseFP8Linear(nn.Linear):
    """Real-kernel layer: torchao's blockwise FP8 kernels, by default in `TracedBlockwiseFn` (option
    `traced_gemm`; false: torchao's `fp8_blockwise_mm` itself). Steps whose token count is not a multiple of 128
    (the Wgrad block runs over tokens) fall back to the exact emulation."""

    def __init__(self, linear: nn.Linear, quantizer: GemmQuantizer, traced: bool = True):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.quantizer = quantizer
        self.traced = traced

    def forward(self, x):
        tokens = x.numel() // x.shape[-1]
        if not x.is_cuda or tokens % BLOCK:
            return EmulatedLinearFn.apply(x, self.weight, self.bias, self.quantizer)
        # torchao's kernels are written for BF16 inputs (Float8BlockwiseLinear.supported_dtypes).
        x, w = x.to(torch.bfloat16).contiguous(), self.weight.to(torch.bfloat16)
        if self.traced:
            return TracedBlockwiseFn.apply(x, w)
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        return fp8_blockwise_mm.apply(x, w, BLOCK, torch.bfloat16, False)


class BlockwiseGemmOps(GemmOps):
    """torchao's blockwise FP8 training kernels (SM90+): the quantizers and GEMMs `fp8_blockwise_mm` runs."""

    def __init__(self, fmt, device, error_bound):
        super().__init__(fmt, device, error_bound)
        self.note = "torchao Triton quantizers + cuBLAS blockwise GEMM"
        self._use_triton_gemm: bool | None = None

    def check_shape(self, shape):
        check_divisible(shape, self.fmt, BLOCK)

    def quantizer(self, role, compiled=False):
        check_role(role)
        from torchao.prototype.blockwise_fp8_training import kernels as bk
        kernels = {  # the quantizers of torchao's fp8_blockwise_mm forward/backward
            ("input", "row"): lambda x: bk.triton_fp8_blockwise_act_quant_lhs(x, BLOCK),
            ("input", "t"): lambda x: bk.triton_fp8_blockwise_act_quant_rhs(x, BLOCK),
            ("weight", "row"): lambda x: bk.triton_fp8_blockwise_weight_quant_transposed_rhs(x, block_size=BLOCK),
            ("weight", "t"): lambda x: bk.triton_fp8_blockwise_weight_quant_rhs(x, block_size=BLOCK),
            ("grad_output", "row"): lambda x: bk.triton_fp8_blockwise_act_quant_lhs(x, BLOCK),
            ("grad_output", "t"): lambda x: bk.triton_fp8_blockwise_act_quant_transposed_lhs(x, BLOCK),
        }
        return lambda x, layouts: tuple(kernels[(role, layout)](x) for layout in layouts)

    def gemm(self, gemm):
        check_pass(gemm)
        return lambda qa, qbt: self._blockwise_gemm(gemm, qa, qbt)

    def quantizer_note(self, compiled):
        return "torchao Triton quantization kernels (those of fp8_blockwise_mm)"

    def _blockwise_gemm(self, gemm, qa, qbt):
        # torchao's default GEMM is cuBLAS blockwise (CUDA ≥ 12.9 on SM90); where this torch/cuBLAS lacks
        # it, torchao's Triton blockwise GEMM is the one training would use, so time that instead.
        if self._use_triton_gemm is None:
            try:
                out = _run_blockwise_mm(gemm, qa, qbt, use_triton=False)
                self._use_triton_gemm = False
                return out
            except Exception as exc:  # noqa: BLE001 - any failure of the cuBLAS path: "not available here"
                self._use_triton_gemm = True
                self.note = (f"torchao Triton quantizers + Triton blockwise GEMM (cuBLAS blockwise failed: "
                             f"{exc})")[:300]
        return _run_blockwise_mm(gemm, qa, qbt, use_triton=self._use_triton_gemm)


def _run_blockwise_mm(gemm, qa, qbt, *, use_triton: bool):
    from torchao.prototype.blockwise_fp8_training import kernels as bk
    from torchao.prototype.blockwise_fp8_training.linear import _run_blockwise_mm as run

    (a, sa), (b, sb) = qa, qbt
    if gemm == "wgrad":
        return run(use_triton=use_triton, triton_kernel=bk.triton_fp8_gemm_1x128_128x1, mat_a=a, mat_b=b,
                   scale_a=sa, scale_recipe_a=bk.BLOCKWISE_1X128_SCALING_TYPE, scale_b=sb.transpose(-1, -2),
                   scale_recipe_b=bk.BLOCKWISE_1X128_SCALING_TYPE, triton_scale_b=sb, out_dtype=torch.bfloat16)
    return run(use_triton=use_triton, triton_kernel=bk.triton_fp8_gemm_1x128_128x128, mat_a=a, mat_b=b,
               scale_a=sa, scale_recipe_a=bk.BLOCKWISE_1X128_SCALING_TYPE, scale_b=sb,
               scale_recipe_b=bk.BLOCKWISE_128X128_SCALING_TYPE, out_dtype=torch.bfloat16)


class BlockwiseEmulatedGemmOps(EmulatedGemmOps):
    """Blockwise FP8 without SM90: kernel-only mode times a BF16 GEMM of the operands quantized and
    dequantized to BF16 (`quantize_dequantize`); with quantization, training's emulation (FP32 values and GEMM,
    as FP32 block scales are not exact in BF16)."""

    separate_quant_gemm = True

    def check_shape(self, shape):
        check_divisible(shape, self.fmt, BLOCK)

    def kernel_quantizer(self, role):
        check_role(role)
        block = (BLOCK, BLOCK) if role == "weight" else BLOCK
        return lambda x, layouts: tuple(quantize_dequantize((x if layout == "row" else x.t()).contiguous(),
                                                            "fp8_blockwise", block_size=block) for layout in layouts)

    def gemm(self, gemm):
        check_pass(gemm)
        return lambda qa, qbt: torch.mm(qa, qbt.t())


@register
class FP8BlockwiseRecipe(Recipe):
    name = "fp8_blockwise"
    gemm_error_bound = 0.08  # E4M3 with per-block scales ≈ 0.04

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
            how = ("torchao blockwise kernels in the compiled graph" if options["traced_gemm"]
                   else "torchao fp8_blockwise_mm")
            return (BlockwiseFP8Linear(linear, quantizer, options["traced_gemm"]), quantizer,
                    f"{how} (1x128 / 128x128)")
        from training.precision.emulation import QuantizedLinear

        return QuantizedLinear(linear, quantizer, self.name), quantizer, f"emulated: {quantizer.describe()}"

    def compile_mode(self, options, real):
        # torchao's quantizers and GEMM are launched from Python (~1,500 launches per 1b step): without graphs the
        # step waits on the host and stalls (bench/NOTES_floor.md section 23).
        if real and options["traced_gemm"] and options["cuda_graphs"] and not options.get("fsdp"):
            return "reduce-overhead"
        return None

    def gemm_ops(self, device):
        if has_capability(device, self.min_capability):
            return BlockwiseGemmOps(self.name, device, self.gemm_error_bound)
        return BlockwiseEmulatedGemmOps(self.name, device, self.gemm_error_bound, BlockwiseQuantizer())
