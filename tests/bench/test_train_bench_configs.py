"""bench/train_bench.py's config strings: per-config GPUs, gradient accumulation and batch (a scaling run
compares `bf16:grad_accum=2` on one GPU with `bf16:gpus=2` on two, same global batch, in one call)."""
from __future__ import annotations

import types

import pytest


def _args(**kw):
    base = dict(gpus=1, batch=8, seq=64, steps=3, warmup=2, model="tiny", device="cpu", rounds=1, profile=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_scaling_configs_parse_into_training_keys(bench):
    one = bench.parse_config("bf16:grad_accum=2")
    two = bench.parse_config("bf16:gpus=2,overlap_optimizer=false")
    assert one["training"] == {"grad_accum": 2} and one["perf"] == {}
    assert two["training"] == {"gpus": 2} and two["perf"] == {"overlap_optimizer": False}
    spec_one = bench.run_spec(one, steps=5, batch=8, seq=64)
    spec_two = bench.run_spec(two, steps=5, batch=8, seq=64)
    assert (spec_one["training"]["gpus"], spec_one["training"]["grad_accum"]) == (1, 2)
    assert spec_two["training"]["gpus"] == 2 and spec_two["training"]["batch_size"] == 8


def test_batch_override_reaches_the_worker_command(bench, tmp_path):
    config = {**bench.parse_config("bf16:batch=4"), "slot": "g1_0"}
    assert "batch" not in config["training"] and config["batch"] == 4
    cmd = bench._worker_cmd(config, _args(), tmp_path, None, None)
    assert cmd[cmd.index("--batch") + 1] == "4" and cmd[cmd.index("--gpus") + 1] == "1"
    assert "torch.distributed.run" not in cmd


def test_a_multi_gpu_config_is_launched_with_torchrun(bench, tmp_path):
    config = {**bench.parse_config("bf16:gpus=2"), "slot": "g1_0"}
    cmd = bench._worker_cmd(config, _args(), tmp_path, None, None)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in cmd
    assert cmd[cmd.index("--gpus") + 1] == "2" and cmd[cmd.index("--batch") + 1] == "8"


@pytest.mark.parametrize("text", ["bf16:gpus=two", "bf16:grad_accum", "bf16:batch=x"])
def test_bad_values_are_refused_with_the_config_named(bench, text):
    with pytest.raises(SystemExit, match=text.split(":")[1].split("=")[0]):
        bench.parse_config(text)


def test_none_stays_a_choice_where_the_option_has_one(bench):
    """`cublaslt_workspace=none` and `activation_checkpointing=none` name a choice; elsewhere none means unset."""
    config = bench.parse_config("fp8_delayed:cublaslt_workspace=none,activation_checkpointing=none,compile_mode=none")
    assert config["perf"] == {"cublaslt_workspace": "none", "compile_mode": None}
    assert config["training"] == {"activation_checkpointing": "none"}
    spec = bench.run_spec(config, steps=3, batch=8, seq=64, model="tiny", device="cpu")
    from training.config import RunSpec
    parsed = RunSpec.from_dict(spec)
    assert parsed.training.perf.cublaslt_workspace == "none" and parsed.training.activation_checkpointing == "none"


def test_train_bench_passes_it_as_a_perf_switch(bench):
    config = bench.parse_config("bf16:loss_weight_grad=per_chunk")
    assert config["perf"] == {"loss_weight_grad": "per_chunk"}
    from training.config import RunSpec
    spec = RunSpec.from_dict(bench.run_spec(config, steps=3, batch=8, seq=64, model="tiny", device="cpu"))
    assert spec.training.perf.loss_weight_grad == "per_chunk"


def test_default_order_runs_the_recipes_with_a_bar_first_and_blockwise_last(bench):
    from training.precision import RECIPES
    order = bench.default_configs(list(RECIPES))
    assert sorted(order) == sorted(RECIPES) and order[0] == "bf16" and order[-1] == "fp8_blockwise"
    assert order.index("nvfp4") < order.index("fp8_rowwise")


def test_recipe_options_parse_into_the_run_spec(bench):
    config = bench.parse_config("mxfp8:recipe.fused_quantize=false,recipe.scale_rounding=floor,fuse_qkv=true")
    assert config["recipe_options"] == {"fused_quantize": False, "scale_rounding": "floor"}
    assert config["perf"] == {"fuse_qkv": True}
    spec = bench.run_spec(config, steps=3, batch=8, seq=64, model="tiny", device="cpu")
    assert spec["recipe_options"] == {"fused_quantize": False, "scale_rounding": "floor"}
    assert bench.run_spec(bench.parse_config("bf16"), steps=3, batch=8, seq=64)["recipe_options"] == {}


def test_model_takes_a_preset_with_some_dims_changed(bench):
    from training.config import MODEL_PRESETS, ModelSpec

    assert bench.run_spec(bench.parse_config("bf16"), steps=1, batch=1, seq=8, model="8b")["model"] == "8b"
    deeper = bench.run_spec(bench.parse_config("bf16"), steps=1, batch=1, seq=8, model="8b:num_hidden_layers=40")
    assert deeper["model"] == {**MODEL_PRESETS["8b"], "num_hidden_layers": 40}
    assert ModelSpec.from_value(deeper["model"]).num_hidden_layers == 40
    for bad in ("9b:num_hidden_layers=40", "8b:layers=40", "8b:num_hidden_layers=-1", "8b:num_hidden_layers"):
        with pytest.raises(SystemExit, match="--model"):
            bench.model_value(bad)


def test_a_model_the_spec_refuses_stops_the_bench_before_it_starts(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--model", "8b:num_attention_heads=7", "--device", "cpu", "--no-anchor", "--configs", "bf16"])
    assert "--model '8b:num_attention_heads=7'" in capsys.readouterr().err


def test_update_diagnostics_parse_and_patch_the_triton_update(bench, monkeypatch):
    from training import optim_kernels

    config = bench.parse_config("bf16:bench.update=host_only,fuse_qkv=true")
    assert config["diagnostic"] == {"update": "host_only"} and config["perf"] == {"fuse_qkv": True}
    assert "diagnostic" not in bench.parse_config("bf16")
    with pytest.raises(SystemExit, match="bench.update"):
        bench.parse_config("bf16:bench.update=never")
    monkeypatch.setattr(optim_kernels, "_adamw_master_kernel", optim_kernels._adamw_master_kernel, raising=False)
    monkeypatch.setattr(optim_kernels, "adamw_master_update", optim_kernels.adamw_master_update)
    bench.apply_diagnostics(config["diagnostic"])
    assert optim_kernels._adamw_master_kernel[(1,)](1, 2, x=3) is None  # launches nothing
    bench.apply_diagnostics({"update": "skip"})
    assert optim_kernels.adamw_master_update([], [], lr=1) is None


def test_inductor_diagnostic_makes_inductor_round_as_eager_does(bench):
    import torch._inductor.config as inductor_config

    config = bench.parse_config("nvfp4:bench.inductor=emulate_precision_casts,compile=true")
    assert config["diagnostic"] == {"inductor": "emulate_precision_casts"}
    assert config["training"] == {"compile": True}
    with pytest.raises(SystemExit, match="bench.inductor"):
        bench.parse_config("nvfp4:bench.inductor=fast")
    # inductor's own patch restores the setting (pytest's monkeypatch would delete it from the config module)
    with inductor_config.patch(emulate_precision_casts=False):
        bench.apply_diagnostics(config["diagnostic"])
        assert inductor_config.emulate_precision_casts is True
    assert inductor_config.emulate_precision_casts is False


def test_inductor_diagnostic_turns_on_coordinate_descent_tuning_alone(bench):
    import torch._inductor.config as inductor_config

    config = bench.parse_config("bf16:bench.inductor=coordinate_descent")
    with inductor_config.patch(coordinate_descent_tuning=False, emulate_precision_casts=False, max_autotune=False):
        bench.apply_diagnostics(config["diagnostic"])
        assert inductor_config.coordinate_descent_tuning is True
        assert inductor_config.emulate_precision_casts is False and inductor_config.max_autotune is False
    assert inductor_config.coordinate_descent_tuning is False


def test_inductor_diagnostics_with_values_set_them(bench):
    """bench.inductor settings that are not switches: the user kernels' layout constraint and the reads threshold
    from which a reused pointwise result is stored once (bench/NOTES_floor.md 59)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(triton_kernel_default_layout_constraint="needs_fixed_stride_order",
                               realize_reads_threshold=4):
        bench.apply_diagnostics(bench.parse_config("fp8_delayed:bench.inductor=flexible_user_kernels")["diagnostic"])
        assert inductor_config.triton_kernel_default_layout_constraint == "flexible_layout"
        assert inductor_config.realize_reads_threshold == 4
        bench.apply_diagnostics(bench.parse_config("fp8_delayed:bench.inductor=realize_reads_3")["diagnostic"])
        assert inductor_config.realize_reads_threshold == 3
    assert inductor_config.triton_kernel_default_layout_constraint == "needs_fixed_stride_order"


def test_inductor_diagnostics_reach_the_triton_sub_config(bench):
    """The mix-order reduction's split size (the RMSNorm backward's weight-gradient partial rows) lives in inductor's
    `triton` sub-config: a dotted name sets it there and nowhere else (bench/NOTES_floor.md 75)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"triton.mix_order_reduction_split_size": None, "triton.mix_order_reduction": True}):
        bench.apply_diagnostics(bench.parse_config("bf16:bench.inductor=mix_split_64")["diagnostic"])
        assert inductor_config.triton.mix_order_reduction_split_size == 64
        assert not hasattr(inductor_config, "mix_order_reduction_split_size")
        bench.apply_diagnostics(bench.parse_config("bf16:bench.inductor=no_mix_order")["diagnostic"])
        assert inductor_config.triton.mix_order_reduction is False
    assert inductor_config.triton.mix_order_reduction_split_size is None
    assert inductor_config.triton.mix_order_reduction is True


def test_a_machine_without_the_api_clients_dependencies_is_told_before_the_reference_runs(bench, capsys,
                                                                                          monkeypatch):
    """On a device machine without a wheel the API client needs, every worker used to fail after the reference had
    run for a minute: the bench now stops first and says which module is missing, or to pass --no-api."""
    import builtins
    import sys

    real_import = builtins.__import__

    def no_pydantic_core(name, *args, **kwargs):
        if name == "pydantic_core" or name.startswith("pydantic_core."):
            raise ModuleNotFoundError("No module named 'pydantic_core'", name="pydantic_core")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "workers.client", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_pydantic_core)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--configs", "bf16", "--model", "tiny", "--device", "cpu", "--no-anchor"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "pydantic_core" in err and "--no-api" in err
