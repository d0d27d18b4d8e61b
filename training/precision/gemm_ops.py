"""The interface between a recipe and the GEMM benchmark (training/gemm): how the recipe quantizes each tensor of a
training step and runs one GEMM pass on quantized operands, on one device.

A linear layer y = x·Wᵀ has three tensors per step - X (T×in, "input"), W (out×in, "weight") and dY (T×out,
"grad_output") - and three GEMMs. Each GEMM reads two of the tensors, each in one of two layouts: "row" (the
tensor as stored, quantized along its rows, i.e. along its last dim) or "t" (its transpose, quantized along the
stored tensor's first dim):

    pass    A (m×k)            B (k×n), given as Bᵀ (n×k)      training quantizer (emulation.GemmQuantizer)
    fprop   X   row            W   row   (Bᵀ = W)              input, weight_fprop
    dgrad   dY  row            W   t     (Bᵀ = Wᵀ)             grad, weight_dgrad
    wgrad   dY  t  (A = dYᵀ)   X   t     (Bᵀ = Xᵀ)             grad_wgrad, input_wgrad

A recipe that owns a GEMM format (catalog: its `gemm_format` is its own name) returns a `GemmOps` from
`Recipe.gemm_ops(device)`; the benchmark only talks to that object:
  - kernel-only mode quantizes the operands outside the timed region with `kernel_quantizer(role)` and times
    `gemm(pass)`;
  - "with quantization" mode times `quantizer(role, compiled)`, the quantizer a training step runs for that
    tensor (all its layouts in one call, as training quantizes each tensor once per layout), and the GEMM
    training runs on its output, `quant_gemm(pass)` - timed on its own where it is not the kernel-only GEMM
    (`separate_quant_gemm`: formats emulated here, whose kernel-only mode keeps timing torchao's emulation).
A quantizer maps a stored BF16 tensor and the layouts it is needed in to one quantized operand per layout; a
GEMM maps the quantized A and Bᵀ to C in BF16.
"""
from __future__ import annotations

from typing import Callable

import torch

from training.precision.emulation import GemmQuantizer, emulated_mm, gemm_dtype

ROLES = ("input", "weight", "grad_output")
LAYOUTS = ("row", "t")
# (role, layout) of A and of B per pass; see the table above.
PASS_OPERANDS = {
    "fprop": (("input", "row"), ("weight", "row")),
    "dgrad": (("grad_output", "row"), ("weight", "t")),
    "wgrad": (("grad_output", "t"), ("input", "t")),
}
# The GemmQuantizer method that quantizes a tensor of a role into a layout, as the training step calls it.
TRAINING_OPERAND = {
    ("input", "row"): "input", ("input", "t"): "input_wgrad",
    ("weight", "row"): "weight_fprop", ("weight", "t"): "weight_dgrad",
    ("grad_output", "row"): "grad", ("grad_output", "t"): "grad_wgrad",
}
EMULATED_LABEL = "emulated – no hardware support"


class UnsupportedShape(Exception):
    """The format cannot run this shape (e.g. dims not multiples of 16); training keeps it in BF16."""


def sm_version(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def check_divisible(shape, fmt: str, multiple: int, dims: str = "mkn") -> None:
    bad = [f"{d.upper()}={getattr(shape, d)}" for d in dims if getattr(shape, d) % multiple]
    if bad:
        raise UnsupportedShape(f"{fmt} needs {', '.join(d.upper() for d in dims)} divisible by {multiple} "
                               f"(got {', '.join(bad)}); training keeps such a layer in BF16")


def check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown operand role {role!r}; expected one of {', '.join(ROLES)}")


def check_pass(gemm: str) -> None:
    if gemm not in PASS_OPERANDS:
        raise ValueError(f"unknown gemm pass {gemm!r}; expected fprop, dgrad or wgrad")


_compiled: dict = {}


def compile_static(fn: Callable) -> Callable:
    """`fn` under torch.compile with static shapes: one graph per tensor shape and layouts, as the compiled
    training step has (a model has about a dozen distinct tensor shapes per format)."""
    if fn not in _compiled:
        import torch._dynamo
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


class GemmOps:
    """One recipe's GEMMs on one device (see the module docstring). `backend` is real | emulated | cpu;
    `compiles`: its quantizers run under torch.compile on CUDA, as in compiled training."""

    compiles = False
    separate_quant_gemm = False

    def __init__(self, fmt: str, device: torch.device, error_bound: float):
        self.fmt, self.device, self.error_bound = fmt, device, error_bound
        self.backend, self.note = "real", ""

    def check_shape(self, shape) -> None:
        """Raise UnsupportedShape if the format cannot run `shape` (a GemmShape: m, k, n, gemm)."""

    def quantizer(self, role: str, compiled: bool = False) -> Callable:
        """The training step's quantizer of a tensor of `role`: q(x, layouts) -> one operand per layout."""
        raise NotImplementedError

    def kernel_quantizer(self, role: str) -> Callable:
        return self.quantizer(role)

    def gemm(self, gemm: str) -> Callable:
        """g(qa, qbt) -> C in BF16, on kernel_quantizer's operands."""
        raise NotImplementedError

    def quant_gemm(self, gemm: str) -> Callable:
        """g(qa, qbt) on quantizer's operands: the GEMM a training step runs."""
        return self.gemm(gemm)

    def quantizer_note(self, compiled: bool) -> str:
        return "torch.compile (static shapes), as in compiled training" if compiled else "eager quantizers"

    def timing_group(self, role: str) -> str:
        """Tensors of roles in one group (and of one shape and layouts) share one quantizer, so one timing."""
        return role


def training_operands(quantizer: GemmQuantizer, role: str, x: torch.Tensor, layouts: tuple) -> tuple:
    """`x` quantized by a recipe's training quantizer in each layout, in the GEMM dtype training uses (BF16
    values on GPU where exact, FP32 otherwise)."""
    dtype = gemm_dtype(x, quantizer)
    return tuple(getattr(quantizer, TRAINING_OPERAND[(role, layout)])(x, dtype=dtype) for layout in layouts)


class EmulatedGemmOps(GemmOps):
    """A format without hardware support on this device: what training's exact emulation runs, the recipe's
    training quantizer (compiled on CUDA, as the compiled training step) and a GEMM on the dequantized values
    (`emulated_mm`), in both modes. Subclasses whose kernel-only mode times another emulation (torchao's) override
    `kernel_quantizer` and `gemm` and set `separate_quant_gemm`."""

    compiles = True

    def __init__(self, fmt: str, device: torch.device, error_bound: float, training: GemmQuantizer):
        super().__init__(fmt, device, error_bound)
        self.backend, self.note = "emulated", EMULATED_LABEL
        self.training = training

    def quantizer(self, role: str, compiled: bool = False) -> Callable:
        check_role(role)
        fn = compile_static(training_operands) if compiled and self.device.type == "cuda" else training_operands
        return lambda x, layouts: fn(self.training, role, x, tuple(layouts))

    def quant_gemm(self, gemm: str) -> Callable:
        check_pass(gemm)
        return lambda qa, qbt: emulated_mm(qa, qbt, torch.bfloat16)

    def gemm(self, gemm: str) -> Callable:
        return self.quant_gemm(gemm)

    def quantizer_note(self, compiled: bool) -> str:
        how = "torch.compile" if compiled else "eager"
        return f"training's quantizers ({self.training.describe()}), {how} ({EMULATED_LABEL})"


class TorchaoBlockScaled:
    """torchao's block-scaled operands (MXTensor, NVFP4Tensor; `what` names the constructor) for mxfp8 and nvfp4:
    `to_torchao(x)` makes the stored form of `x` (blocks of `block` along its last dim, i.e. along K); `dispatch`
    is torchao's block-scaled GEMM where the hardware has it, None where it does not: the operands are then
    dequantized to BF16 and multiplied (torchao's emulated path)."""

    def __init__(self, what: str, block: int, to_torchao: Callable, dispatch: Callable | None):
        self.what, self.block, self.to_torchao, self.dispatch = what, block, to_torchao, dispatch

    def check_shape(self, shape, fmt: str) -> None:
        check_divisible(shape, fmt, self.block, "k")  # blocks along K

    def quantizer(self, role: str) -> Callable:
        check_role(role)
        return lambda x, layouts: tuple(self.to_torchao((x if layout == "row" else x.t()).contiguous())
                                        for layout in layouts)

    def gemm(self, gemm: str) -> Callable:
        check_pass(gemm)
        if self.dispatch is not None:
            from torch.ops import aten
            return lambda qa, qbt: self.dispatch(qa, qbt.t(), aten.mm.default)
        return lambda qa, qbt: torch.mm(qa.dequantize(torch.bfloat16), qbt.dequantize(torch.bfloat16).t())


def has_capability(device: torch.device, capability: tuple[int, int] | None) -> bool:
    """Whether `device` is a CUDA GPU of at least `capability` (the catalog's real_min_capability)."""
    return capability is not None and device.type == "cuda" and sm_version(device) >= 10 * capability[0] + capability[1]


class TorchaoBlockScaledOps(GemmOps):
    """mxfp8 / nvfp4 where the GPU has block-scaled tensor cores: torchao's quantizers and GEMM in both modes,
    as torchao's training linears run them."""

    def __init__(self, fmt: str, device: torch.device, error_bound: float, torchao: TorchaoBlockScaled):
        super().__init__(fmt, device, error_bound)
        self.torchao = torchao
        self.note = "torchao CUTLASS/cuBLAS block-scaled GEMM (scale swizzle inside the timed region)"

    def check_shape(self, shape) -> None:
        self.torchao.check_shape(shape, self.fmt)

    def quantizer(self, role: str, compiled: bool = False) -> Callable:
        return self.torchao.quantizer(role)

    def gemm(self, gemm: str) -> Callable:
        return self.torchao.gemm(gemm)

    def quantizer_note(self, compiled: bool) -> str:
        return f"torchao {self.torchao.what}, eager"

    def timing_group(self, role: str) -> str:
        return "any"  # one quantizer for every role


class EmulatedTorchaoOps(EmulatedGemmOps):
    """mxfp8 / nvfp4 without block-scaled tensor cores: kernel-only mode times torchao's emulated path
    (its operands dequantized to BF16, then a BF16 GEMM); with quantization, training's emulation."""

    separate_quant_gemm = True

    def __init__(self, fmt: str, device: torch.device, error_bound: float, training: GemmQuantizer,
                 torchao: TorchaoBlockScaled, *, role_independent: bool = False):
        super().__init__(fmt, device, error_bound, training)
        self.torchao, self.role_independent = torchao, role_independent

    def check_shape(self, shape) -> None:
        self.torchao.check_shape(shape, self.fmt)

    def kernel_quantizer(self, role: str) -> Callable:
        return self.torchao.quantizer(role)

    def gemm(self, gemm: str) -> Callable:
        return self.torchao.gemm(gemm)

    def timing_group(self, role: str) -> str:
        return "any" if self.role_independent else role


def scaled_mm_shape_reason(linear, recipe: str):
    """Why `linear` cannot run on torch._scaled_mm (every GEMM dimension divisible by 16), or None; the per-tensor
    FP8 recipes (fp8_tensorwise, fp8_rowwise, fp8_delayed) skip such layers with this reason."""
    for what, dim in (("in_features", linear.in_features), ("out_features", linear.out_features)):
        if dim % 16:
            return f"{what} {dim} not a multiple of 16 required by FP8 tensor cores ({recipe})"
    return None
