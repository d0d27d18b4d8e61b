"""The GPU-only bench scripts import and parse their arguments on a CPU machine (`--help`): a broken import or
argument table shows here, not at the start of a paid GPU call."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["carveout_probe.py", "kernel_bench.py", "transpose_store_probe.py",
                                    "cublaslt_workspace_probe.py", "amax_pass_probe.py",
                                    "adamw_tile_probe.py", "nvfp4_quant_probe.py",
                                    "first_compile_probe.py", "nvfp4_swiglu_probe.py"])
def test_gpu_bench_script_imports_and_prints_its_usage(script):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout and "--" in proc.stdout


def test_the_transpose_probe_counts_stores_of_fp8_casts_per_kernel():
    from bench.transpose_store_probe import fp8_stores
    kernel = """async_compile.triton('k', '''
@triton.jit
def triton_poi_fused_cast_0(in_ptr0, out_ptr0, out_ptr1, xnumel, XBLOCK : tl.constexpr):
    tmp0 = tl.load(in_ptr0 + (x0), None).to(tl.float32)
    tmp1 = tmp0 * tmp0
    tmp2 = tmp1.to(tl.float8e4nv)
    tl.store(out_ptr0 + (x0), tmp2, None)
    tl.store(out_ptr1 + (x0), tmp2, None)
    tl.store(out_ptr1 + (x0), tmp1, None)
''', device_str='cuda')
async_compile.triton('j', '''
@triton.jit
def triton_poi_fused_add_1(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tmp0 = tl.load(in_ptr0 + (x0), None)
    tl.store(out_ptr0 + (x0), tmp0, None)
''', device_str='cuda')
"""
    assert fp8_stores([kernel]) == {"triton_poi_fused_cast_0": 2}


def test_the_workspace_probe_trains_each_run_in_a_fresh_process_and_records_it(tmp_path):
    """On a CPU the workspace choice resolves to torch's default whatever is asked, so both runs give one curve; the
    record (status, seconds, losses, the autotune policy) is what a GPU call's result will hold."""
    import json

    proc = subprocess.run([sys.executable, str(REPO / "bench" / "cublaslt_workspace_probe.py"), "--device", "cpu",
                           "--recipes", "fp8_rowwise", "--timeout-s", "200", "--results-dir", str(tmp_path / "results")],
                          cwd=tmp_path, capture_output=True,
                          text=True, timeout=500, env={**__import__("os").environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "cublaslt_workspace_probe.json").read_text())
    assert [p.name.startswith("cublaslt_workspace_probe_cpu_") for p in (tmp_path / "results").iterdir()] == [True]
    assert result["device"] == "cpu" and result["blockwise_autotune"] == "quick" and result["git_commit"]
    default, none = result["runs"]
    assert (default["workspace"], none["workspace"]) == ("default", "none")
    assert default["status"] == none["status"] == "succeeded" and len(default["losses"]) == 4
    assert default["cublaslt_workspace"] == none["cublaslt_workspace"] == "default"  # no cuBLASLt on a CPU
    assert default["losses"] == none["losses"]


def test_the_adamw_tile_probe_parses_tiles_and_names_a_malformed_one(capsys):
    from bench.adamw_tile_probe import main, tile_arg

    assert tile_arg("512:4") == (512, 4, None) and tile_arg("2048:8:8") == (2048, 8, 8)
    for bad in ("512", "512:3", "500:4", "512:4:0", "a:b", "512:4:8:1"):
        with pytest.raises(SystemExit) as exc:
            main(["--tiles", "512:4", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert repr(bad) in err and "BLOCK:WARPS" in err, err


def test_the_adamw_tile_probe_times_the_shard_update_with_plain_tiles_only(capsys):
    from bench.adamw_tile_probe import main

    with pytest.raises(SystemExit) as exc:
        main(["--shard", "--tiles", "512:4", "2048:8:8"])
    assert exc.value.code == 2 and "BLOCK:WARPS" in capsys.readouterr().err


def test_the_adamw_tile_probe_times_the_steps_own_tile_first_and_once(monkeypatch):
    # the first tile is the one every other is checked against bit for bit, and the one a reader compares with: it
    # must be what the step runs, whatever the step's tile becomes
    from bench.adamw_tile_probe import default_tiles
    from training import optim_kernels as ok

    monkeypatch.setattr(ok, "BLOCK", 256)
    monkeypatch.setattr(ok, "NUM_WARPS", 2)
    tiles = default_tiles(shard=False)
    assert tiles[0] == (256, 2, None) and tiles.count((256, 2, None)) == 1
    shard = default_tiles(shard=True)
    assert shard[0] == (ok.SHARD_BLOCK, ok.SHARD_NUM_WARPS, None) and shard.count(shard[0]) == 1
    monkeypatch.setattr(ok, "BLOCK", 2048)
    monkeypatch.setattr(ok, "NUM_WARPS", 8)
    assert default_tiles(shard=False).count((2048, 8, None)) == 1


def test_the_nvfp4_quant_probe_parses_its_tiles_and_names_a_malformed_one(capsys, tmp_path):
    from bench.nvfp4_quant_probe import amax_tile_arg, config_arg, main

    assert config_arg("128:2:4") == (128, 2, 4) and amax_tile_arg("256:4") == (256, 4)
    for flag, bad in (("--configs", "128:2"), ("--configs", "128:3:4"), ("--configs", "8:1:4"),
                      ("--amax-tiles", "256:4:4"), ("--amax-tiles", "x:4"), ("--modules", f"old={tmp_path}/none.py"),
                      ("--modules", "old")):
        with pytest.raises(SystemExit) as exc:
            main([flag, bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert repr(bad) in err, err


def test_the_adamw_tile_probe_lays_every_parameter_into_its_flat_state_once():
    import torch

    from bench.adamw_tile_probe import flat_state

    params = [torch.randn(s).bfloat16() for s in ((3, 4), (5,), (2, 2), (7,))]
    flat, lists = flat_state(params, "cpu")
    (views_2d, wd_2d), (views_1d, wd_1d) = lists
    assert (wd_2d, wd_1d) == (0.1, 0.0) and flat["p"].numel() == 12 + 5 + 4 + 7
    assert [tuple(v.shape) for v in views_2d["p"]] == [(3, 4), (2, 2)]
    assert [tuple(v.shape) for v in views_1d["p"]] == [(5,), (7,)]
    for view, q in zip(views_2d["p"] + views_1d["p"], (params[0], params[2], params[1], params[3])):
        assert torch.equal(view, q)
    for k, t in flat.items():  # each kind's views tile its buffer in order, without overlap
        offsets = [v.data_ptr() - t.data_ptr() for v in views_2d[k] + views_1d[k]]
        sizes = [v.numel() * t.element_size() for v in views_2d[k] + views_1d[k]]
        assert offsets == [sum(sizes[:i]) for i in range(len(sizes))], k


def test_the_first_compile_probe_names_state_a_step_builds_and_kernels_that_differ():
    """What bench/first_compile_probe.py reports, on what a step could do: an NVFP4 layer's quantizer building its
    kernels' RHT operand for another device is named as changed state, a weight changed in place as changed; of two
    output codes, the kernel whose source differs and the kernels only in one, and how many graphs each has."""
    import torch

    from bench.first_compile_probe import code_changes, graph_count, module_state, state_changes
    from training.model import build_model, llama_config
    from training.precision import apply_recipe

    model = build_model(llama_config({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                                      "num_attention_heads": 2, "num_key_value_heads": 2}, 128, 32), 0)
    apply_recipe(model, "nvfp4")
    before = module_state(model)
    assert state_changes(before, module_state(model)) == []
    down = model.model.layers[0].mlp.down_proj
    down.quantizer.rht_operand(torch.device("meta"))  # the layer's own device's was built with the quantizer
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1
    changes = sorted(state_changes(before, module_state(model)))
    assert len(changes) == 2, changes
    assert changes[0].startswith("changed model.layers.0.mlp.down_proj.quantizer._rht_operands: {'cpu': tensor(16, "
                                 "16) torch.bfloat16 cpu"), changes[0]
    assert "'meta': tensor(16, 16) torch.bfloat16 meta}" in changes[0], changes[0]
    assert changes[1].startswith("changed model.layers.0.mlp.up_proj.weight: tensor(128, 64) torch.float32 cpu")

    def code(*kernels):
        return "\n".join(f"{name} = async_compile.triton('{name}', '''\n{body}\n''', device_str='cuda')"
                         for name, body in kernels) + "\ncall(args)"
    first = code(("triton_poi_fused_mul_0", "tmp1 = tmp0 * tmp0"), ("triton_red_fused_max_1", "tmp2 = max(tmp1)"))
    second = code(("triton_poi_fused_mul_0", "tmp1 = tmp0 * 2.0"), ("triton_poi_fused_add_2", "tmp3 = tmp0 + 1"))
    found = code_changes(first, second)
    assert found["only_first"] == ["triton_red_fused_max_1"] and found["only_second"] == ["triton_poi_fused_add_2"]
    assert list(found["differ"]) == ["triton_poi_fused_mul_0"]
    assert "+tmp1 = tmp0 * 2.0" in found["differ"]["triton_poi_fused_mul_0"]
    assert found["kernels"] == [2, 2] and found["wrapper_differs"]  # it launches other kernels
    assert graph_count("def call(self, args):\n    pass\n" * 3) == 3 and graph_count(first) == 0
    body_only = code(("triton_poi_fused_mul_0", "tmp1 = tmp0 * 2.0"), ("triton_red_fused_max_1", "tmp2 = max(tmp1)"))
    found = code_changes(first, body_only)
    assert list(found["differ"]) == ["triton_poi_fused_mul_0"] and not found["wrapper_differs"]
    assert code_changes(first, first) == {"only_first": [], "only_second": [], "differ": {}, "kernels": [2, 2],
                                          "wrapper_differs": False}
