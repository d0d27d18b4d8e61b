"""The recipe catalog: what each precision recipe is, in one place, importable without torch.

Every consumer reads it: the registry (`training.precision`, whose recipe modules keep only their conversion
and GEMM code), the run spec (`training.config.RunSpec`), the API's schemas and `GET /api/v1/recipes`, the
dashboard's recipe lists and the GEMM benchmark's formats. It is plain data and plain Python so the API
validates a submission (recipe name and options) without loading torch.

Each `RecipeEntry` holds the recipe's name, a one-line summary, its elements and scaling, its typed options
(`RecipeOption`: name, type, default, allowed values or range, help), the GEMM format the benchmark times it
as (`gemm_format`: the name of the recipe that owns those GEMM operands; fp8_delayed's GEMMs are per-tensor
FP8, i.e. `fp8_tensorwise`'s), the minimum CUDA compute capability of its real kernels and whether it runs as
exact emulation elsewhere. `module` names the module that implements it (conversion + GEMM operands).
`quantizer_bytes` (activation or gradient operand, weight): bytes per element its quantizers must move – each
BF16 input read once per pass it needs, each layout the GEMMs read written once – the floor that
`bench/step_profile.py` divides the measured quantizer time by (None: no quantizers, or not worked out).
`cublaslt_workspace` ("default" or "none"): what `training.perf.cublaslt_workspace: auto` gives the recipe's process
on a GPU where its real kernels run (elsewhere its GEMMs are BF16 on emulated operands, and auto keeps torch's
default). "none" only where the recipe's loss curve without the workspace was shown to stay within its own
run-to-run spread on a GPU (bench/curve_ab.py; the result file is named beside the entry).

The order is the documented recipe order (README's recipe list): error messages and every list in the UI follow it.
Recipes outside this file join through `add_recipe(entry)`, called by a module named in the environment
variable `PLAB_RECIPE_MODULES` (comma-separated, imported on the first look at the catalog, in every process:
API, worker, CLI); such a module must stay torch-free, its `module` holds the torch code.
"""
from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

BASELINE = "bf16"
OPTION_TYPES = ("boolean", "integer", "string")
SCALE_ROUNDINGS = ("floor", "rceil")
CUBLASLT_WORKSPACES = ("default", "none")  # what training.perf.cublaslt_workspace "auto" may resolve to
EXTENSIONS_ENV = "PLAB_RECIPE_MODULES"
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


# Which blocks' linears a recipe converts: chosen beside the recipe, for every recipe, not among its options.
LAYER_CHOICES = ("bf16_first_layers", "bf16_last_layers", "keep_bf16")


class RecipeError(ValueError):
    """An unknown recipe or an option value it does not accept; the message says what is allowed."""


@dataclass(frozen=True)
class RecipeOption:
    """One typed option of a recipe. `choices` (strings) or `minimum`/`maximum` (integers) bound its values."""

    name: str
    type: str
    default: Any
    help: str
    choices: Optional[tuple] = None
    minimum: Optional[int] = None
    maximum: Optional[int] = None

    def allowed(self) -> str:
        """What the option accepts, as the end of the sentence "must be ..."."""
        if self.type == "boolean":
            return "true or false"
        if self.type == "string":
            return "one of " + ", ".join(self.choices)
        if self.maximum is not None:
            low = "" if self.minimum is None else f" from {self.minimum}"
            return f"an integer{low} up to {self.maximum}"
        return {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
            self.minimum, f"an integer >= {self.minimum}")

    def accepts(self, value: Any) -> bool:
        if self.type == "boolean":
            return isinstance(value, bool)
        if self.type == "string":
            return isinstance(value, str) and value in self.choices
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        return ((self.minimum is None or value >= self.minimum)
                and (self.maximum is None or value <= self.maximum))

    def check(self, value: Any, recipe: str) -> None:
        if not self.accepts(value):
            raise RecipeError(f"option {self.name} of {recipe} must be {self.allowed()}, got {value!r}")

    def to_dict(self) -> dict:
        return {"name": self.name, "type": self.type, "default": self.default,
                "choices": list(self.choices) if self.choices is not None else None,
                "minimum": self.minimum, "maximum": self.maximum, "help": self.help}


@dataclass(frozen=True)
class RecipeEntry:
    """One recipe as the catalog describes it (see the module docstring for the fields)."""

    name: str
    summary: str
    elements: str
    scaling: str
    gemm_format: str
    real_kernels: str
    real_min_capability: Optional[tuple[int, int]]
    emulated_elsewhere: bool
    options: tuple[RecipeOption, ...] = ()
    module: str = field(default="", compare=False)
    quantizer_bytes: Optional[tuple[int, int]] = None
    cublaslt_workspace: str = "default"

    @property
    def implementation(self) -> str:
        """The module that implements the recipe (registers its `Recipe` class when imported)."""
        return self.module or f"training.precision.{self.name}"

    def defaults(self) -> dict[str, Any]:
        return {option.name: option.default for option in self.options}

    def resolve_options(self, given: dict) -> dict[str, Any]:
        """`given` with every default filled in; raises RecipeError naming the option, the bad value and what
        is allowed."""
        if not isinstance(given, dict):
            raise RecipeError(f"options of {self.name} must be an object of option name -> value, got {given!r}")
        known = {option.name: option for option in self.options}
        unknown = sorted(set(given) - set(known), key=str)
        if unknown:
            valid = ", ".join(sorted(known)) or "none"
            message = (f"unknown option(s) {', '.join(map(str, unknown))} for recipe {self.name!r}; "
                       f"valid options: {valid}")
            layer_choices = [str(k) for k in unknown if k in LAYER_CHOICES]
            if layer_choices:
                message += (f" ({', '.join(layer_choices)}: not a recipe option but a key of its own, beside the "
                            f"recipe's name in an experiment's recipe entry, beside `recipe` in a run spec)")
            raise RecipeError(message)
        for name, value in given.items():
            known[name].check(value, self.name)
        return {**self.defaults(), **given}

    def to_dict(self) -> dict:
        cap = self.real_min_capability
        return {"name": self.name, "summary": self.summary, "elements": self.elements, "scaling": self.scaling,
                "gemm_format": self.gemm_format, "options": [option.to_dict() for option in self.options],
                "real_min_capability": list(cap) if cap is not None else None, "real_kernels": self.real_kernels,
                "emulated_elsewhere": self.emulated_elsewhere}


def _bool(name: str, default: bool, help: str) -> RecipeOption:
    return RecipeOption(name, "boolean", default, help)


_BUILTIN = (
    RecipeEntry(
        name="bf16",
        summary="BF16 compute (autocast), FP32 master weights; the baseline every other recipe is compared with",
        elements="BF16 operands, FP32 accumulation", scaling="none", gemm_format="bf16",
        real_kernels="BF16 tensor cores on any CUDA GPU; the train loop computes in FP32 on a CPU",
        real_min_capability=None, emulated_elsewhere=False),
    RecipeEntry(
        name="fp8_delayed",
        summary="E4M3 X/W, E5M2 dY; per-tensor scales from an amax history (max over the last N steps)",
        elements="E4M3 X and W, E5M2 dY",
        scaling="one FP32 scale per tensor = FP8 max / max of the amax history of the previous steps "
                "(Transformer Engine's DelayedScaling)",
        gemm_format="fp8_tensorwise", real_kernels="torch._scaled_mm with delayed scaling (ours)",
        real_min_capability=(8, 9), emulated_elsewhere=True,
        options=(RecipeOption("amax_history_len", "integer", 1024, "steps of amax history the scale is taken "
                              "from (the max over them)", minimum=1),
                 _bool("fused_cast", False, "real GEMMs take their FP8 operands from one Triton cast-transpose "
                                            "pass per operand (bit-identical codes; off: slower in the compiled "
                                            "step than inductor's casts, which fuse into the producers)"),
                 _bool("cuda_graphs", True, "real GEMMs with inductor's casts, one GPU, layers compiled one by one, "
                                            "no activation checkpointing or numerics sampling: the layers replay as "
                                            "CUDA graphs (torch.compile mode reduce-overhead) unless "
                                            "training.perf.compile_mode names a mode; the same median step, "
                                            "without the host-bound stretches of the plain step"),
                 _bool("one_pass_cast", True, "real GEMMs with inductor's casts: each operand's cast writes its "
                                              "row-major FP8 codes and records its amax in one pass (the amax "
                                              "reduced along rows, then over them), and the transposed layouts "
                                              "Wgrad and Dgrad read are copied from the 1-byte codes by a Triton "
                                              "kernel; same codes and amaxes (off: a separate amax pass and "
                                              "casts that re-read the BF16 operand for the transposed layout)"),
                 _bool("fused_swiglu", True, "real GEMMs with the one-pass casts, Llama MLPs with separate gate and "
                                             "up projections: once the amax history exists, the SwiGLU and its "
                                             "backward each run as one Triton pass that writes the FP8 codes in "
                                             "both layouts the next GEMMs read and records the amax (inductor's "
                                             "math, the same codes; off: inductor's kernel and a transposing "
                                             "copy of its codes)"),
                 _bool("fused_qkv_rope", True, "real GEMMs with the one-pass casts, a fused QKV projection "
                                               "(training.perf.fuse_qkv): once the amax history exists, the "
                                               "projection's dY (RoPE's backward of dQ and dK, and dV) is cast to "
                                               "E5M2 by one Triton pass that writes both layouts and the amax "
                                               "(inductor's math, the same codes; off: inductor's kernel, which "
                                               "stores the codes twice, and a transposing copy)")),
        quantizer_bytes=(4, 4),  # scale from the history: the amax is recorded during the one cast pass
        # 4 runs against 2 on an H100, permutation p = 0.87:
        # bench/results/curve_ab_2026-11-28T0448_H100_fp8_delayed_workspace_none_4x2_at_8d46a2f.json
        cublaslt_workspace="none",
    ),
    RecipeEntry(
        name="fp8_tensorwise",
        summary="E4M3 X/W, E5M2 dY; one scale per tensor from its current amax",
        elements="E4M3 X and W, E5M2 dY",
        scaling="one FP32 scale per tensor from its current amax (\"FP8-CS\")",
        gemm_format="fp8_tensorwise",
        real_kernels="torch._scaled_mm: our current-scaling linear (torchao's tensorwise Float8Linear under FSDP2 or "
                     "with implementation torchao)",
        real_min_capability=(8, 9), emulated_elsewhere=True,
        options=(RecipeOption("implementation", "string", "auto",
                              "real kernels: torchao = torchao's Float8Linear (tensorwise); plab = our linear "
                              "(training.precision.fp8_tensorwise.CurrentScalingLinear) on the same torch._scaled_mm "
                              "GEMMs with the same casts and scales, whose backward reuses the forward's FP8 codes of "
                              "X and W and copies transposed layouts from the 1-byte codes (bit-identical layer; on an "
                              "H200 1.6-1.7 ms less per 1b step and 4.9 ms per 3b step, for 2.7 / 6.3 GiB more "
                              "peak memory: the codes it keeps); auto = plab, except under FSDP2, where torchao's "
                              "Float8Linear all-gathers the weights in FP8. Emulated GEMMs take the emulation either "
                              "way", choices=("auto", "torchao", "plab")),
                 _bool("fused_swiglu", True, "our linear (implementation plab) on real GEMMs, Llama MLPs with "
                                             "separate gate and up projections: the SwiGLU and its backward each "
                                             "run as two Triton passes, one that computes the amax and one that "
                                             "writes the FP8 codes in both layouts the next GEMMs read (fp8_delayed's "
                                             "fused_swiglu kernel with current scales; inductor's math, the same "
                                             "codes; off: inductor's amax and cast kernels and a transposing copy "
                                             "of the codes)"),
                 _bool("fused_qkv_rope", True, "our linear (implementation plab) on real GEMMs, a fused QKV projection "
                                               "(training.perf.fuse_qkv): the projection's dY (RoPE's backward of dQ "
                                               "and dK, and dV) is cast to E5M2 by an amax pass and one Triton pass "
                                               "that writes both layouts (fp8_delayed's fused_qkv_rope kernel with "
                                               "a current scale; the same codes; off: inductor's kernels and a "
                                               "transposing copy)")),
        quantizer_bytes=(6, 6),  # amax read + cast read (2 x 2 B), two FP8 layouts (2 x 1 B)
        # 4 runs against 2 on an H100, permutation p = 0.67:
        # bench/results/curve_ab_2026-11-28T0600_H100_fp8_tensorwise_workspace_none_4x2_at_7848a8f.json
        cublaslt_workspace="none",
    ),
    RecipeEntry(
        name="fp8_rowwise",
        summary="E4M3 everywhere; power-of-two scale per row/column along each GEMM's reduction dim",
        elements="E4M3 for every operand",
        scaling="one power-of-two scale per row of each GEMM operand, along its reduction dim",
        gemm_format="fp8_rowwise", real_kernels="torchao Float8Linear (rowwise; fast kernels on sm_90+)",
        real_min_capability=(8, 9), emulated_elsewhere=True,
        quantizer_bytes=(6, 6),  # the Wgrad layout's column scales span all tokens: a full pass before its cast
    ),
    RecipeEntry(
        name="fp8_blockwise",
        summary="E4M3; FP32 scales per 1x128 (activations, gradients) and 128x128 (weights) blocks",
        elements="E4M3 for every operand",
        scaling="one FP32 scale per 1x128 run (X, dY) and per 128x128 tile (W); dims multiples of 128, no bias",
        gemm_format="fp8_blockwise",
        real_kernels="torchao prototype blockwise_fp8_training (Triton quantizers, blockwise GEMM)",
        real_min_capability=(9, 0), emulated_elsewhere=True,
        options=(_bool("traced_gemm", True, "real kernels: the layer's forward and backward stay inside the "
                                            "compiled graph, torchao's GEMM called through its custom op (false: "
                                            "torchao's fp8_blockwise_mm, which the compiler runs eagerly)"),
                 _bool("cuda_graphs", True, "real kernels in the compiled graph, one GPU, layers compiled one by one, "
                                            "no activation checkpointing or numerics sampling: the layers replay as "
                                            "CUDA graphs (torch.compile mode reduce-overhead) unless "
                                            "training.perf.compile_mode names a mode; the step is otherwise "
                                            "host-bound (torchao's kernels are launched from Python)")),
        quantizer_bytes=(4, 4),  # 1x128 / 128x128 scales are local
    ),
    RecipeEntry(
        name="mxfp8",
        summary="E4M3 + E8M0 power-of-two scale per 32 elements along the reduction dim",
        elements="E4M3 for every operand",
        scaling="one E8M0 (power-of-two) scale per 32 elements along each GEMM's reduction dim (OCP MX)",
        gemm_format="mxfp8", real_kernels="torchao MXFP8Linear (MXFP8 tensor cores)",
        real_min_capability=(10, 0), emulated_elsewhere=True,
        options=(RecipeOption("scale_rounding", "string", "rceil", "E8M0 scale rule: rceil (cuBLAS/Blackwell, "
                              "the block max never saturates) or floor (OCP spec)", choices=SCALE_ROUNDINGS),
                 _bool("fused_quantize", True, "on CUDA, quantize X, W and dY with the fused Triton kernel (false: "
                                               "the torch quantizers, for an A/B)")),
        quantizer_bytes=(6, 6),  # 1x32 scales are local: one read, two BF16 layouts
    ),
    RecipeEntry(
        name="nvfp4",
        summary="E2M1 + E4M3 scale per 16 + FP32 tensor scale; 16x16 weight tiles, 16-point RHT on Wgrad "
                "inputs, stochastic rounding of gradients",
        elements="E2M1 for every operand",
        scaling="one E4M3 scale per 16 elements (16x16 tiles for W) and one FP32 scale per tensor",
        gemm_format="nvfp4",
        real_kernels="torchao NVFP4Linear (NVFP4 tensor cores; only with rht, stochastic_rounding and weight_2d on)",
        real_min_capability=(10, 0), emulated_elsewhere=True,
        options=(
            _bool("rht", True, "16-point random Hadamard transform of both Wgrad operands along tokens"),
            _bool("stochastic_rounding", True, "stochastic rounding of the gradient dY (8 random bits per element, "
                                               "as the hardware: unbiased to 1/256 of a grid step)"),
            _bool("weight_2d", True, "16x16 weight tiles, so Fprop and Dgrad share one quantized weight "
                                     "(false: 1x16 blocks)"),
            RecipeOption("rht_seed", "integer", 0, "seed of the transform's random sign vector", minimum=0),
            _bool("fused_quantize", True, "on CUDA, quantize X and dY with the fused Triton kernels (false: the "
                                          "torch quantizers, for an A/B)"),
            _bool("share_mlp_input", True, "with fused_quantize, a Llama MLP's gate and up quantize their common "
                                           "input once instead of twice (the same values; false: each its own, "
                                           "for an A/B)"),
            _bool("fused_swiglu", True, "with share_mlp_input, a Llama MLP's SwiGLU and its backward each run as one "
                                        "Triton pass that also reduces the per-tensor maxima of h, dL/dgate and "
                                        "dL/dup, so their quantization skips its amax pass (inductor's math, the "
                                        "same values in a compiled step; false: the layers' path, for an A/B)"),
        ),
        quantizer_bytes=(8, 6),  # per-tensor amax first; W's 16x16 tiles are transpose-invariant: one layout
    ),
)

_entries: dict[str, RecipeEntry] = {}
_extensions_loaded = False


def _check_entry(entry: RecipeEntry) -> None:
    if not isinstance(entry, RecipeEntry):
        raise TypeError(f"add_recipe takes a RecipeEntry, got {type(entry).__name__}")
    if not _NAME.match(entry.name):
        raise ValueError(f"recipe name {entry.name!r} must be lower-case letters, digits and underscores "
                         "(starting with a letter, at most 40)")
    cap = entry.real_min_capability
    if cap is not None and not (isinstance(cap, tuple) and len(cap) == 2 and all(isinstance(c, int) for c in cap)):
        raise ValueError(f"real_min_capability of {entry.name!r} must be None or (major, minor), got {cap!r}")
    for option in entry.options:
        if option.type not in OPTION_TYPES:
            raise ValueError(f"option {option.name} of {entry.name} has type {option.type!r}; use one of "
                             f"{', '.join(OPTION_TYPES)}")
        if option.type == "string" and not option.choices:
            raise ValueError(f"string option {option.name} of {entry.name} needs its choices")
        option.check(option.default, entry.name)
    if entry.cublaslt_workspace not in CUBLASLT_WORKSPACES:
        raise ValueError(f"cublaslt_workspace of {entry.name!r} must be one of {', '.join(CUBLASLT_WORKSPACES)}, "
                         f"got {entry.cublaslt_workspace!r}")


def _check_gemm_format(entry: RecipeEntry, entries: dict[str, RecipeEntry]) -> None:
    """A recipe's GEMM format is its own name or another recipe that owns its GEMM operands."""
    owner = entries.get(entry.gemm_format)
    if owner is None or owner.gemm_format != owner.name:
        raise ValueError(f"gemm_format {entry.gemm_format!r} of recipe {entry.name!r} must be the recipe's own "
                         f"name or one of the GEMM formats {', '.join(_gemm_formats(entries))}")


def _gemm_formats(entries: dict[str, RecipeEntry]) -> tuple[str, ...]:
    return tuple(name for name, entry in entries.items() if entry.gemm_format == name)


def add_recipe(entry: RecipeEntry) -> None:
    """Add a recipe after the built-in ones (call it from a module named in PLAB_RECIPE_MODULES)."""
    current = _catalog()
    _check_entry(entry)
    if entry.name in current:
        raise ValueError(f"recipe {entry.name!r} is already in the catalog; choose another name")
    _check_gemm_format(entry, {**current, entry.name: entry})
    current[entry.name] = entry


def _catalog() -> dict[str, RecipeEntry]:
    global _extensions_loaded
    if not _entries:
        builtin = {entry.name: entry for entry in _BUILTIN}
        for entry in _BUILTIN:
            _check_entry(entry)
            _check_gemm_format(entry, builtin)
        _entries.update(builtin)
    if not _extensions_loaded:
        _extensions_loaded = True  # before importing: the extension modules call add_recipe
        for name in filter(None, (part.strip() for part in os.environ.get(EXTENSIONS_ENV, "").split(","))):
            try:
                importlib.import_module(name)
            except ImportError as exc:
                raise ImportError(f"{EXTENSIONS_ENV} names {name!r}, which does not import: {exc}") from exc
    return _entries


def recipes() -> tuple[RecipeEntry, ...]:
    """Every recipe, in the documented order (extensions last)."""
    return tuple(_catalog().values())


def recipe_names() -> tuple[str, ...]:
    return tuple(_catalog())


def get(name: str) -> RecipeEntry:
    """The recipe called `name`; RecipeError listing the valid names otherwise."""
    entries = _catalog()
    if not isinstance(name, str) or name not in entries:
        raise RecipeError(f"unknown recipe {name!r}; choose one of {', '.join(entries)}")
    return entries[name]


# The GEMM benchmark's modes: the kernel alone, or with the quantization of its operands (training.gemm).
GEMM_MODES = ("kernel", "quant")


def gemm_formats() -> tuple[str, ...]:
    """The GEMM benchmark's formats, in catalog order: every recipe that owns its GEMM operands."""
    return _gemm_formats(_catalog())


def catalog_dict() -> dict:
    """The catalog as `GET /api/v1/recipes` answers it."""
    return {"baseline": BASELINE, "recipes": [entry.to_dict() for entry in recipes()],
            "gemm_formats": list(gemm_formats())}
