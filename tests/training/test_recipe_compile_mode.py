"""A recipe may name the torch.compile mode its layers run best under (fp8_blockwise: CUDA graphs, because torchao's
kernels are launched from Python and the step is otherwise host-bound; fp8_delayed: CUDA graphs, its steps
host-bound at times). The run takes it only where it has been
measured to work, and a mode the spec names always wins."""
from types import SimpleNamespace

import pytest

from training.precision.fp8_blockwise import FP8BlockwiseRecipe
from training.precision.fp8_delayed import FP8DelayedRecipe
from training.precision.registry import RecipeReport
from training.setup import _compile_mode

GRAPH = "reduce-overhead"


@pytest.mark.parametrize("options,real,expected", [
    ({"traced_gemm": True, "cuda_graphs": True}, True, GRAPH),
    ({"traced_gemm": True, "cuda_graphs": False}, True, None),
    ({"traced_gemm": False, "cuda_graphs": True}, True, None),    # torchao's function runs eagerly anyway
    ({"traced_gemm": True, "cuda_graphs": True}, False, None),    # emulated: no Python-launched kernels
    ({"traced_gemm": True, "cuda_graphs": True, "fsdp": True}, True, None),
])
def test_blockwise_asks_for_cuda_graphs_only_for_its_traced_real_kernels(options, real, expected):
    assert FP8BlockwiseRecipe().compile_mode(options, real) == expected


@pytest.mark.parametrize("options,real,expected", [
    ({"cuda_graphs": True, "fused_cast": False}, True, GRAPH),
    ({"cuda_graphs": False, "fused_cast": False}, True, None),
    ({"cuda_graphs": True, "fused_cast": True}, True, None),     # not measured with the Triton cast kernels
    ({"cuda_graphs": True, "fused_cast": False}, False, None),   # emulated
    ({"cuda_graphs": True, "fused_cast": False, "fsdp": True}, True, None),
])
def test_delayed_asks_for_cuda_graphs_only_for_its_real_gemms_with_inductors_casts(options, real, expected):
    assert FP8DelayedRecipe().compile_mode(options, real) == expected


def _t(mode=None, scope="auto", compile_=True, numerics_every=0):
    return SimpleNamespace(compile=compile_, numerics_every=numerics_every,
                           perf=SimpleNamespace(compile_mode=mode, compile_scope=scope))


def _pick(t, recipe_mode=GRAPH, parallel="single", on_cuda=True, ac="none", per_layer=True):
    return _compile_mode(t, RecipeReport(recipe="fp8_blockwise", compile_mode=recipe_mode), parallel, on_cuda,
                         {"mode": ac}, per_layer=per_layer)


def test_the_recipes_mode_applies_on_one_gpu_with_per_layer_graphs():
    assert _pick(_t()) == GRAPH
    assert _pick(_t(scope="layers"), per_layer=False) == GRAPH


@pytest.mark.parametrize("kw", [dict(on_cuda=False), dict(parallel="ddp"), dict(parallel="fsdp"), dict(ac="full"),
                                dict(ac="blocks"), dict(per_layer=False), dict(recipe_mode=None)])
def test_the_recipes_mode_is_not_taken_where_it_was_not_measured(kw):
    assert _pick(_t(), **kw) is None


def test_numerics_sampling_keeps_inductors_default():
    assert _pick(_t(numerics_every=10)) is None


def test_a_mode_the_spec_names_wins_and_no_compile_means_no_mode():
    assert _pick(_t(mode="default")) == "default"
    assert _pick(_t(mode="max-autotune-no-cudagraphs")) == "max-autotune-no-cudagraphs"
    assert _pick(_t(mode=None, scope="model"), per_layer=True) is None
    assert _pick(_t(compile_=False)) is None


def test_a_cpu_blockwise_run_reports_no_recipe_mode():
    import torch.nn as nn

    from training.precision import apply_recipe
    model = nn.Sequential()
    model.layers = nn.ModuleList([nn.Sequential(nn.Linear(128, 256, bias=False))])
    report = apply_recipe(model, "fp8_blockwise")
    assert report.to_dict()["compile_mode"] is None
    assert any(layer["converted"] for layer in report.layers)
