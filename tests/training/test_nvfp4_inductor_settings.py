"""NVFP4's inductor setting for a compiled step (nvfp4.inductor_settings): the fused quantizers' two kernels take the
operand in the layout inductor gives them ("flexible_layout"), so a producer fused by inductor stores it once instead
of once per kernel, only where the fused path runs and every layer's widths keep their row stride under inductor's
padding; training.train applies it around the loop and restores inductor's own after. On a GPU the compiled layers'
values under both settings are compared in tests/precision/test_nvfp4_layout_gpu.py."""
from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config

from training.model import build_model, llama_config
from training.precision import apply_recipe
from training.precision.nvfp4 import FLEXIBLE_USER_KERNELS, inductor_settings, keeps_row_stride
from training.precision.registry import get_recipe
from training.sink import ListSink
from training.train import train

pytest.importorskip("triton")  # the fused path needs Triton (CUDA builds of torch ship it)


def _model(recipe: str, hidden: int = 64, inter: int = 128, **options):
    config = llama_config({"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2}, 97, 32)
    model = build_model(config, 0)
    apply_recipe(model, recipe, **options)
    return model


def test_fused_nvfp4_layers_on_a_gpu_ask_for_the_flexible_layout():
    model = _model("nvfp4")
    assert inductor_settings(model, on_cuda=True) == FLEXIBLE_USER_KERNELS
    assert get_recipe("nvfp4").inductor_settings(model, True) == FLEXIBLE_USER_KERNELS
    assert FLEXIBLE_USER_KERNELS == {"triton_kernel_default_layout_constraint": "flexible_layout"}
    # the name and value are inductor's (a patch with an unknown name or value would fail here or at lowering)
    with inductor_config.patch(FLEXIBLE_USER_KERNELS):
        assert inductor_config.triton_kernel_default_layout_constraint == "flexible_layout"


def test_no_setting_on_cpu_without_the_fused_path_or_for_other_recipes():
    assert inductor_settings(_model("nvfp4"), on_cuda=False) == {}
    assert inductor_settings(_model("nvfp4", fused_quantize=False), on_cuda=True) == {}
    for recipe in ("bf16", "mxfp8", "fp8_tensorwise"):
        model = _model(recipe)
        assert get_recipe(recipe).inductor_settings(model, True) == {}
        assert inductor_settings(model, on_cuda=True) == {}  # no NVFP4 layer in it


def test_a_width_inductor_would_pad_keeps_each_kernels_copy_in_the_traced_strides():
    # 1040 features: a multiple of 16 (NVFP4's block) over the 1024-element threshold and not of 64 BF16 elements
    # (128 bytes): inductor's comprehensive padding could round the row stride up to 1088, while the kernels read
    # rows 1040 apart (the stride traced at compile time is a constant in the graph). Layers kept in BF16 do not
    # count.
    assert all(keeps_row_stride(w) for w in (2048, 8192, 5632, 14336, 1024, 80, 32))
    assert not keeps_row_stride(1040) and not keeps_row_stride(2064)
    with inductor_config.patch(comprehensive_padding=False):
        assert keeps_row_stride(1040)
    with inductor_config.patch(padding_alignment_bytes=32):
        assert keeps_row_stride(1040)
    with inductor_config.patch(padding_stride_threshold=64):
        assert not keeps_row_stride(80)
    assert inductor_settings(_model("nvfp4", inter=1040), on_cuda=True) == {}  # the MLP's width
    assert inductor_settings(_model("nvfp4", inter=1040, keep_bf16=["layers.*.mlp.*"]), on_cuda=True) == FLEXIBLE_USER_KERNELS


def test_train_runs_its_loop_under_the_setting_and_restores_inductors_own(make_spec, cache_dir, monkeypatch):
    import training.setup as setup_mod
    import training.train as train_mod

    default = inductor_config.triton_kernel_default_layout_constraint
    assert default != "flexible_layout"
    monkeypatch.setattr(setup_mod, "_inductor_settings", lambda spec, model, on_cuda: dict(FLEXIBLE_USER_KERNELS))
    seen = []
    loop = train_mod.train_loop

    def watched(*args, **kwargs):
        seen.append(inductor_config.triton_kernel_default_layout_constraint)
        return loop(*args, **kwargs)

    monkeypatch.setattr(train_mod, "train_loop", watched)
    sink = ListSink()
    result = train(make_spec(recipe="nvfp4", training={"steps": 2, "val_every": 0}), sink, cache_dir=cache_dir)
    assert result.status == "succeeded"
    assert seen == ["flexible_layout"]
    assert inductor_config.triton_kernel_default_layout_constraint == default
    assert sink.events_of("run_info")[0]["inductor_settings"] == FLEXIBLE_USER_KERNELS
    assert result.summary["inductor_settings"] == FLEXIBLE_USER_KERNELS


def test_an_uncompiled_run_has_no_setting(make_spec, cache_dir):
    sink = ListSink()
    result = train(make_spec(recipe="nvfp4", training={"steps": 2, "warmup_steps": 0, "val_every": 0, "compile": False}), sink,
                   cache_dir=cache_dir)
    assert result.status == "succeeded" and sink.events_of("run_info")[0]["inductor_settings"] == {}
