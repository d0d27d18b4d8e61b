"""Precision recipes: the seam where number formats plug into training.

What each recipe is - its name, summary, elements and scaling, typed options with their defaults, the GEMM
format the GEMM benchmark times it as, the compute capability of its real kernels - is written once, in the
recipe catalog (catalog.py, importable without torch; `RECIPES` is its names in the documented order). Each
recipe module (bf16.py, fp8_*.py, mxfp8.py, nvfp4.py) holds the code only: its `Recipe` (conversion, hooks)
registered under its catalog name, its `GemmQuantizer` (the three GEMMs' operands) and, for a recipe that owns a
GEMM format, `gemm_ops(device)` (gemm_ops.py: the GEMM benchmark's quantizers and GEMMs, the training quantizers
in its "with quantization" mode). A recipe module is imported the first time the recipe is asked for; adding a
recipe is a catalog entry plus one module (docs/EXTENDING.md).

`apply_recipe(model, name, *, bf16_first_layers=0, bf16_last_layers=0, keep_bf16=(), backend="auto", **options)`
converts the nn.Linear layers inside the decoder blocks of any transformers causal LM (blocks found by
structure, linears by type); embeddings, norms and the LM head stay high precision. Blocks
`i < bf16_first_layers` and `i >= n - bf16_last_layers` stay BF16 (the NVFP4 paper keeps the last 4).
It returns a `RecipeReport`: `.layers` (every block linear, converted or skipped and why), `.gemm_backend`
("real", "emulated" or "bf16"; the run's setup says "fp32" for a baseline computing in FP32 on a CPU), `.hooks` (call `post_optimizer_step(model)` after each optimizer step and, where a hook has it,
`post_backward(model)` after each micro-batch's backward when accumulating gradients;
`state_dict()` / `load_state_dict()` go into checkpoints), `.to_dict()` (JSON-able),
`.set_numerics_sampling(on)` / `.collect_numerics()` (see numerics.py).

Backends: "auto" runs real low-precision kernels where the GPU has them and exact emulation elsewhere
(quantize -> dequantize straight to BF16, exact for these formats -> plain BF16 GEMM with FP32
accumulation on GPU, per-tensor scales applied to its BF16 result (NVFP4: a second rounding, see
emulation.py); FP32 math on CPU; the Fprop, Dgrad and Wgrad operands are each quantized in their own
format and block orientation, blocks along each GEMM's reduction dim). "emulated" forces emulation;
"real" raises if real kernels are unavailable and says why. Emulated throughput is not the format's
throughput: label it.

Parameters: FP32 parameters under CUDA BF16 autocast, or BF16 parameters without autocast (FP32 masters
in the optimizer), or FP32 on CPU. Converted layers return the activation (autocast) dtype and gradients
in the dtypes of their input and weight; fp8_delayed keeps its scaling state in FP32 either way.

Recipes (X activations, W weights, dY output gradients):
  bf16            BF16 autocast compute, FP32 master weights. The baseline. Any device.
  fp8_delayed     X, W in E4M3, dY in E5M2; one scale per tensor = FP8 max / max of an amax history of
                  the previous `amax_history_len` steps (default 1024), updated after each optimizer step
                  (Transformer Engine's DelayedScaling; ours, torchao dropped it).
                  Real: torch._scaled_mm on sm_89+ (Ada/Hopper/Blackwell).
  fp8_tensorwise  X, W in E4M3, dY in E5M2; one scale per tensor from its current amax ("FP8-CS").
                  Real: torchao Float8Linear "tensorwise" on sm_89+.
  fp8_rowwise     E4M3 for all operands; one power-of-two scale per row along each GEMM's reduction dim.
                  Real: torchao Float8Linear "rowwise" on sm_89+ (fast kernels on sm_90+).
  fp8_blockwise   E4M3; FP32 scales per 1x128 (X, dY) and per 128x128 tile (W); dims must be multiples of
                  128, no bias. Real: torchao prototype blockwise_fp8_training on sm_90+ (Hopper).
  mxfp8           E4M3 + E8M0 power-of-two scale per 32 elements along the reduction dim, all operands;
                  option scale_rounding "rceil" (default) or "floor". Real: torchao MXFP8Linear on sm_100+
                  (Blackwell); exact emulation on Hopper and CPU.
  nvfp4           E2M1 + E4M3 scale per 16 elements + FP32 per-tensor scale; 1x16 blocks for X and dY,
                  16x16 tiles for W (option weight_2d), 16-point random Hadamard transform on both Wgrad
                  operands along tokens (option rht, sign vector seeded by rht_seed), stochastic rounding
                  of dY (option stochastic_rounding). Real: torchao NVFP4Linear on sm_100+ with all parts
                  on; exact emulation on Hopper and CPU.

`quantize_dequantize(x, fmt, *, block_size=None, scale_rounding=None, stochastic=False, generator=None)`
is the format contract of ARCHITECTURE.md (bit-exact with torchao's MXFP8 and NVFP4 reference quantizers).

The real-kernel paths cannot run on CPU; `python -m training.precision.gpu_check --out FILE.json` checks them
on a GPU in one call (backend choice, real vs emulated agreement, training, compile, bit-exactness on GPU).
Emulated GEMMs in eager mode cost many elementwise kernels per layer; for throughput runs use
`training.compile`, which fuses each quantizer (every recipe traces into one graph with no breaks and no
host synchronisation; tests/precision checks fullgraph compilation against eager).
"""
from __future__ import annotations

import importlib

from training.precision.catalog import BASELINE, RecipeEntry, RecipeError, RecipeOption, recipe_names

RECIPES = recipe_names()

# Everything below needs torch; it loads on first use, so the catalog (and RECIPES) stay torch-free for the
# API, the run spec and the dashboard.
_TORCH_SIDE = {"apply_recipe": "registry", "RecipeReport": "registry", "REGISTRY": "registry",
               "quantize_dequantize": "formats", "FORMATS": "formats"}


def __getattr__(name: str):
    if name not in _TORCH_SIDE:
        raise AttributeError(f"module 'training.precision' has no attribute {name!r}")
    module = importlib.import_module(f"training.precision.{_TORCH_SIDE[name]}")
    if _TORCH_SIDE[name] == "registry":
        module.load_recipes()
    value = getattr(module, name)
    globals()[name] = value
    return value


__all__ = ["RECIPES", "BASELINE", "FORMATS", "RecipeEntry", "RecipeError", "RecipeOption", "RecipeReport",
           "apply_recipe", "quantize_dequantize"]
