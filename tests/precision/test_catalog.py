"""The recipe catalog: torch-free, in the documented order, typed options whose errors say what is allowed."""
from __future__ import annotations

import subprocess
import sys

import pytest

from training.precision import catalog

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def _run_without_torch(code: str) -> str:
    """Run `code` in a fresh interpreter in which `import torch` fails."""
    prelude = "import sys; sys.modules['torch'] = None\n"
    done = subprocess.run([sys.executable, "-c", prelude + code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_catalog_imports_and_validates_without_torch():
    out = _run_without_torch(
        "from training.precision import catalog, RECIPES\n"
        "catalog.get('nvfp4').resolve_options({'rht': False})\n"
        "print(','.join(RECIPES), ','.join(catalog.gemm_formats()))\n"
        "print('torch' in sys.modules and sys.modules['torch'] is not None)\n")
    names, formats = out.splitlines()[0].split()
    assert names.split(",") == list(catalog.recipe_names())
    assert formats.split(",") == list(catalog.gemm_formats())
    assert out.splitlines()[1] == "False"


def test_recipes_follow_the_documented_order_and_bf16_is_the_baseline():
    assert catalog.recipe_names() == ("bf16", "fp8_delayed", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise",
                                      "mxfp8", "nvfp4")
    assert catalog.BASELINE == catalog.recipe_names()[0]


def test_gemm_formats_are_the_recipes_that_own_their_gemm_operands():
    assert catalog.gemm_formats() == ("bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4")
    # Delayed scaling changes where the scale comes from, not the GEMM: per-tensor FP8 operands.
    assert catalog.get("fp8_delayed").gemm_format == "fp8_tensorwise"


def test_options_and_defaults_are_the_recipes_documented_ones():
    defaults = {entry.name: entry.defaults() for entry in catalog.recipes()}
    assert defaults == {
        "bf16": {}, "fp8_tensorwise": {"implementation": "auto", "fused_swiglu": True, "fused_qkv_rope": True},
        "fp8_rowwise": {},
        "fp8_blockwise": {"traced_gemm": True, "cuda_graphs": True},
        "fp8_delayed": {"amax_history_len": 1024, "fused_cast": False, "cuda_graphs": True, "one_pass_cast": True,
                        "fused_swiglu": True, "fused_qkv_rope": True},
        "mxfp8": {"scale_rounding": "rceil", "fused_quantize": True},
        "nvfp4": {"rht": True, "stochastic_rounding": True, "weight_2d": True, "rht_seed": 0, "fused_quantize": True,
                  "share_mlp_input": True, "fused_swiglu": True},
    }
    for entry in catalog.recipes():
        assert all(option.help for option in entry.options), entry.name


def test_capability_says_where_real_kernels_run():
    caps = {entry.name: entry.real_min_capability for entry in catalog.recipes()}
    assert caps == {"bf16": None, "fp8_delayed": (8, 9), "fp8_tensorwise": (8, 9), "fp8_rowwise": (8, 9),
                    "fp8_blockwise": (9, 0), "mxfp8": (10, 0), "nvfp4": (10, 0)}
    assert [e.name for e in catalog.recipes() if not e.emulated_elsewhere] == ["bf16"]


@pytest.mark.parametrize("recipe, options, message", [
    ("nvfp4", {"rht": "yes"}, "option rht of nvfp4 must be true or false, got 'yes'"),
    ("nvfp4", {"rht_seed": -1}, "option rht_seed of nvfp4 must be a non-negative integer, got -1"),
    ("nvfp4", {"rht_seed": True}, "option rht_seed of nvfp4 must be a non-negative integer, got True"),
    ("nvfp4", {"rht_seed": 1.0}, "option rht_seed of nvfp4 must be a non-negative integer, got 1.0"),
    ("fp8_delayed", {"amax_history_len": 0}, "option amax_history_len of fp8_delayed must be a positive integer"),
    ("mxfp8", {"scale_rounding": "even"}, "option scale_rounding of mxfp8 must be one of floor, rceil, got 'even'"),
    ("nvfp4", {"hadamard": True}, "unknown option(s) hadamard for recipe 'nvfp4'; valid options: fused_quantize, "
                                  "fused_swiglu, rht, rht_seed, share_mlp_input, stochastic_rounding, weight_2d"),
    ("fp8_tensorwise", {"amax_history_len": 16}, "unknown option(s) amax_history_len for recipe 'fp8_tensorwise'; "
                                                 "valid options: fused_qkv_rope, fused_swiglu, implementation"),
    ("fp8_tensorwise", {"implementation": "te"}, "option implementation of fp8_tensorwise must be one of auto, "
                                                 "torchao, plab, got 'te'"),
    ("fp8_rowwise", {"implementation": "plab"}, "valid options: none"),
    ("nvfp4", {"bf16_last_layers": 4, "rht": True}, "unknown option(s) bf16_last_layers for recipe 'nvfp4'; valid "
     "options: fused_quantize, fused_swiglu, rht, rht_seed, share_mlp_input, stochastic_rounding, weight_2d "
     "(bf16_last_layers: not a recipe option but a key of its own, beside the recipe's name in an experiment's "
     "recipe entry, beside `recipe` in a run spec)"),
])
def test_a_bad_option_names_the_option_the_value_and_what_is_allowed(recipe, options, message):
    with pytest.raises(catalog.RecipeError) as info:
        catalog.get(recipe).resolve_options(options)
    assert message in str(info.value)


def test_resolved_options_fill_in_the_defaults():
    assert catalog.get("mxfp8").resolve_options({}) == {"scale_rounding": "rceil", "fused_quantize": True}
    assert catalog.get("nvfp4").resolve_options({"rht": False, "rht_seed": 7})["rht_seed"] == 7


def test_an_unknown_recipe_lists_the_valid_names():
    with pytest.raises(catalog.RecipeError, match="unknown recipe 'fp6'; choose one of bf16, fp8_delayed, "
                                                   "fp8_tensorwise, fp8_rowwise, fp8_blockwise, mxfp8, nvfp4"):
        catalog.get("fp6")


def test_the_endpoint_body_has_the_promised_shape():
    body = catalog.catalog_dict()
    assert set(body) == {"baseline", "recipes", "gemm_formats"} and body["baseline"] == "bf16"
    for recipe in body["recipes"]:
        assert set(recipe) >= {"name", "summary", "elements", "scaling", "gemm_format", "options",
                               "real_min_capability", "real_kernels", "emulated_elsewhere"}
        for option in recipe["options"]:
            assert set(option) == {"name", "type", "default", "choices", "minimum", "maximum", "help"}
    nvfp4 = next(r for r in body["recipes"] if r["name"] == "nvfp4")
    assert nvfp4["real_min_capability"] == [10, 0]
    assert nvfp4["options"][3] == {"name": "rht_seed", "type": "integer", "default": 0, "choices": None,
                                   "minimum": 0, "maximum": None, "help": nvfp4["options"][3]["help"]}


@pytest.mark.parametrize("change, message", [
    (dict(name="MXFP6"), "lower-case letters"),
    (dict(name="nvfp4"), "already in the catalog"),
    (dict(gemm_format="fp8_delayed"), "must be the recipe's own name or one of the GEMM formats"),
    (dict(real_min_capability=(10,)), "must be None or (major, minor)"),
    (dict(options=(catalog.RecipeOption("k", "float", 1.0, "a float"),)), "use one of boolean, integer, string"),
    (dict(options=(catalog.RecipeOption("k", "integer", -1, "a count", minimum=0),)), "option k of"),
])
def test_add_recipe_refuses_an_entry_that_would_break_the_catalog(change, message):
    entry = catalog.RecipeEntry(**{**dict(name="tmp_fp6", summary="s", elements="e", scaling="s",
                                          gemm_format="tmp_fp6", real_kernels="none", real_min_capability=None,
                                          emulated_elsewhere=True), **change})
    with pytest.raises((ValueError, TypeError)) as info:
        catalog.add_recipe(entry)
    assert message in str(info.value)
    assert "tmp_fp6" not in catalog.recipe_names()
