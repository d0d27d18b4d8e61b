"""`fp8_tensorwise`: FP8 with per-tensor *current* scaling ("FP8-CS"; torchao `tensorwise`).

X and W in E4M3, dY in E5M2 (gradients need range more than precision); each tensor's scale is
448 (or 57344) / its current amax. Real kernels (`torch._scaled_mm`, sm_89+), option `implementation`:
`CurrentScalingLinear` below (plab; `auto` outside FSDP2), bit-identical with torchao's tensorwise `Float8Linear`
as a layer and ~1.6 ms faster per 1b step on an H200 because its backward reuses the forward's FP8 codes; torchao's
`Float8Linear` (torchao; `auto` under FSDP2, where it all-gathers the weights in FP8).

GEMM benchmark (`Float8GemmOps`, shared with fp8_rowwise; fp8_delayed's GEMMs are timed as these): torch._scaled_mm
on FP8 operands - FP8 tensor cores on CUDA, torch's CPU kernel on a CPU - cast by this module's quantizers: one
scale per tensor shared by both layouts for tensorwise (torchao casts a tensor for its two GEMMs with one amax),
one power-of-two scale per row of each layout for rowwise; E4M3, dY in E5M2 for tensorwise (torchao
`Float8LinearConfig()`); fast accumulation on fprop only (torchao `gemm_config_output`; its rowwise recipe
keeps that default). On CUDA the casts run under torch.compile, as in the compiled training step, where amax,
scale, cast and the transposed write fuse.
"""
from __future__ import annotations

import torch
from torch import nn

from training.precision.emulation import GemmQuantizer, QuantizedLinear, compute_dtype
from training.precision.formats import fp8_cast, fp8_scale_from_amax, quantize_fp8_tensorwise
from training.precision.fp8_delayed import (DelayedFP8Fn, _current_scale, _weight_both_layouts, fuse_qkv_rope,
                                            fuse_swiglu_mlp)
from training.precision.gemm_ops import (GemmOps, UnsupportedShape, check_divisible, check_pass, check_role,
                                         compile_static, has_capability, scaled_mm_shape_reason, sm_version)
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

    def grad_wgrad(self, dy2d, *, dtype=torch.float32):
        return quantize_fp8_tensorwise(dy2d, E5M2, dtype=dtype).t()

    def input_wgrad(self, x2d, *, dtype=torch.float32):
        return quantize_fp8_tensorwise(x2d, E4M3, dtype=dtype).t()

    def describe(self):
        return "E4M3 X/W, E5M2 dY, per-tensor current scaling"


class CurrentScalingLinear(QuantizedLinear):
    """fp8_tensorwise on our kernels (option `implementation: plab`): the same recipe as torchao's tensorwise
    Float8Linear - each of X, W and dY cast to FP8 with the scale from its current amax (torchao's
    `amax_to_scale`), E4M3 X/W, E5M2 dY, fast accumulation on Fprop only, the bias added in the output dtype -
    through fp8_delayed's `DelayedFP8Fn` with no history. What differs is the data movement:
    - backward reuses the FP8 codes of X and W saved in forward (per-tensor scaling is transpose-invariant,
      so they are the codes torchao's backward casts again from the BF16 X and W it saved);
    - the amaxes reduce along rows, then over them, the loop shape of the row-major cast, and the transposed
      layouts Wgrad and Dgrad read are copied from the 1-byte codes by a Triton kernel
      (fp8_triton.fp8_transpose) instead of re-reading the BF16 operand.
    Elsewhere (CPU, pre-Ada GPUs, token counts not divisible by 16) the same casts feed the exact emulation.
    The recipe's options `fused_swiglu` and `fused_qkv_rope` run a Llama MLP's three layers, and a fused QKV
    projection with RoPE, through fp8_delayed's fused functions with current scaling (`fusable_current`)."""

    def __init__(self, linear: nn.Linear, real: bool):
        super().__init__(linear, TensorwiseQuantizer(), "fp8_tensorwise")
        self.real = real

    def reuses_weight_when(self, compiled: bool) -> bool:
        return False  # W is cast in the layer's graph with the codes its backward keeps

    @property
    def fused_ready(self) -> bool:
        """Whether fp8_delayed's fused functions (options fused_swiglu, fused_qkv_rope) run this layer, with current
        scaling: always on the real kernels (they need no history)."""
        return self.real

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != out_dtype:
            x2 = x2.to(out_dtype)  # under autocast the kernels see the autocast (BF16) copy, as torchao's
        real = self.real and x2.shape[0] % 16 == 0  # torch._scaled_mm: every dim divisible by 16
        s_x, s_w = _current_scale(x2, E4M3), _current_scale(self.weight, E4M3)
        # W's codes in both layouts from one pass over W (a Triton kernel on a GPU; the same codes as the cast)
        w8, w8t, _ = _weight_both_layouts(self.weight.detach(), s_w) if real else (None, None, None)
        y = DelayedFP8Fn.apply(x2, self.weight, self.bias, s_x, s_w, None, None, None, real, out_dtype,
                               False, True, w8, w8t)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, recipe=fp8_tensorwise, "
                f"implementation=plab, real={self.real}")


def fusable_current(layer) -> bool:
    """A layer fp8_delayed's fused functions (DelayedSwiGLUMLPFn, DelayedQKVRoPEFn) take with current scaling: our
    real CurrentScalingLinear without a bias."""
    return isinstance(layer, CurrentScalingLinear) and layer.real and layer.bias is None


def torchao_float8_linear(linear, recipe_name: str, fsdp: bool = False):
    """torchao's Float8Linear for `linear`; under FSDP2 a tensorwise one all-gathers its weight in FP8."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(recipe_name)
    if fsdp and recipe_name == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return Float8Linear.from_float(linear, config=config)


class Float8AllGatherScales:
    """After each optimizer step: every FP8-all-gathered weight's scale from its new amax, all layers in one
    pass (torchao `precompute_float8_dynamic_scale_for_fsdp`), so the all-gather does not compute one per
    layer in the next forward."""

    def post_optimizer_step(self, model) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def fp8_quantize_layouts(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, layouts: tuple) -> tuple:
    """Training's FP8 cast of one tensor for torch._scaled_mm: per layout, the row-major FP8 matrix (x or xᵀ)
    and its inverse scale (a scalar, or one per row of that matrix for rowwise). The quantizers of
    TensorwiseQuantizer (one amax for all layouts) and RowwiseQuantizer (one per row of each layout), with the
    FP8 codes kept instead of the dequantized values."""
    if not rowwise:
        q = quantize_fp8_tensorwise(x, dtype, dtype=dtype)
        return tuple((q.values if layout == "row" else q.values.t().contiguous(), q.outer) for layout in layouts)
    out = []
    for layout in layouts:
        src = x if layout == "row" else x.t()
        scale = fp8_scale_from_amax(src.abs().amax(dim=1, keepdim=True), dtype, power_of_2=True)
        out.append((fp8_cast(src, scale, dtype)[0].contiguous(), scale.reciprocal()))
    return tuple(out)


def fp8_scaled_mm(qa, sa, qbt, sbt, fast_accum: bool) -> torch.Tensor:
    """C = A·B from row-major FP8 A (m×k) and Bᵀ (n×k); rowwise scales of Bᵀ come as (n, 1)."""
    return torch._scaled_mm(qa, qbt.t(), scale_a=sa, scale_b=sbt.t() if sbt.dim() else sbt,
                            out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


class Float8GemmOps(GemmOps):
    """Per-tensor (or, `rowwise`, per-row) FP8 GEMMs on torch._scaled_mm (see the module docstring)."""

    compiles = True

    def __init__(self, fmt, device, error_bound, *, min_capability, rowwise: bool):
        super().__init__(fmt, device, error_bound)
        self.rowwise = rowwise
        if device.type == "cuda" and not has_capability(device, min_capability):
            need = 10 * min_capability[0] + min_capability[1]
            raise UnsupportedShape(f"{fmt} needs FP8 tensor cores (SM{need}+); this GPU is SM{sm_version(device)}")
        self.backend = "real" if device.type == "cuda" else "cpu"

    def check_shape(self, shape):
        check_divisible(shape, self.fmt, 16, "kn")  # torch._scaled_mm: K and N multiples of 16

    def quantizer(self, role, compiled=False):
        check_role(role)
        dtype = E5M2 if not self.rowwise and role == "grad_output" else E4M3
        fn = compile_static(fp8_quantize_layouts) if compiled and self.device.type == "cuda" else fp8_quantize_layouts
        return lambda x, layouts: fn(x, dtype, self.rowwise, tuple(layouts))

    def gemm(self, gemm):
        check_pass(gemm)
        fast_accum = gemm == "fprop" and self.device.type == "cuda"
        return lambda qa, qbt: fp8_scaled_mm(*qa, *qbt, fast_accum)

    def quantizer_note(self, compiled):
        return ("torch.compile (static shapes): amax, scale, cast and transposed write fused as in compiled "
                "training" if compiled else "eager quantizers")

    def timing_group(self, role):
        if self.rowwise:
            return "any"  # one quantizer for every role
        return "grad_output" if role == "grad_output" else "e4m3"  # E5M2 for dY, E4M3 otherwise


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
        if real and self.implementation(options) == "plab":
            new = CurrentScalingLinear(linear, real)
            return new, new.quantizer, "torch._scaled_mm, current scaling (ours: implementation plab)"
        quantizer = self.quantizer_cls()
        if real:
            gather8 = options.get("fsdp") and self.torchao_recipe == "tensorwise"
            return (torchao_float8_linear(linear, self.torchao_recipe, fsdp=bool(gather8)), quantizer,
                    f"torchao Float8Linear ({self.torchao_recipe}{', FP8 all-gather' if gather8 else ''})")
        return QuantizedLinear(linear, quantizer, self.name), quantizer, f"emulated: {quantizer.describe()}"

    @staticmethod
    def implementation(options) -> str:
        """fp8_tensorwise's option `implementation` resolved: "auto" is plab except under FSDP2 (torchao's FP8
        all-gather); recipes without the option (fp8_rowwise) are torchao's."""
        chosen = options.get("implementation") or "torchao"
        return ("torchao" if options.get("fsdp") else "plab") if chosen == "auto" else chosen

    def make_hooks(self, converted, options):
        real = any(type(m).__name__ == "Float8Linear" for _, m in converted)
        return [Float8AllGatherScales()] if real and options.get("fsdp") and self.torchao_recipe == "tensorwise" else []

    def gemm_ops(self, device):
        return Float8GemmOps(self.name, device, self.gemm_error_bound, min_capability=self.min_capability,
                             rowwise=self.torchao_recipe == "rowwise")


@register
class FP8TensorwiseRecipe(TorchaoFloat8Recipe):
    name = "fp8_tensorwise"
    torchao_recipe = "tensorwise"
    quantizer_cls = TensorwiseQuantizer

    shared_note = ("our current-scaling linears (implementation plab): the MLP's SwiGLU and its backward each run as "
                   "an amax pass and one Triton pass that writes both FP8 layouts (fused_swiglu), and the QKV "
                   "projection's dY comes from the same two passes over dQ, dK and dV through RoPE's backward "
                   "(fused_qkv_rope)")

    def share_inputs(self, block, options: dict, real: bool) -> int:
        if not real:
            return 0
        mlp = fuse_swiglu_mlp(block, fusable_current) if options.get("fused_swiglu") else 0
        qkv = fuse_qkv_rope(block, fusable_current) if options.get("fused_qkv_rope") else 0
        return 1 if mlp or qkv else 0
    gemm_error_bound = 0.12  # E4M3 X/W ≈ 0.04, E5M2 dY ≈ 0.07
