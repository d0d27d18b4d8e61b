"""The GEMM benchmark reads its formats from the recipe catalog and its operand code from the recipes, and in
"with quantization" mode it runs the quantizers a training step runs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from training.gemm import ERROR_BOUNDS, FORMATS, run_gemm_benchmark
from training.gemm.cli import build_parser
from training.precision import RECIPES, catalog
from training.precision.emulation import gemm_dtype
from training.precision.formats import Quantized
from training.precision.gemm_ops import LAYOUTS, ROLES, TRAINING_OPERAND, GemmOps
from training.precision.registry import get_recipe

CPU = torch.device("cpu")
LOW_PRECISION = [r for r in RECIPES if r != catalog.BASELINE]
# Rows and columns multiples of 128 (blockwise tiles) with different row and column counts (layouts differ).
TENSOR_SHAPE = (256, 384)


def test_gemm_formats_are_the_catalogs_and_each_comes_from_its_recipe():
    assert FORMATS == catalog.gemm_formats()
    assert build_parser().parse_args(["--model", "tiny"]).formats == list(FORMATS)
    assert set(ERROR_BOUNDS) == set(FORMATS) - {catalog.BASELINE}
    for fmt in ERROR_BOUNDS:
        ops = get_recipe(fmt).gemm_ops(CPU)
        assert isinstance(ops, GemmOps) and ops.fmt == fmt and ops.error_bound == ERROR_BOUNDS[fmt]


def test_a_recipe_without_gemm_operands_of_its_own_says_which_format_times_it():
    with pytest.raises(NotImplementedError, match="times it as 'fp8_tensorwise'"):
        get_recipe("fp8_delayed").gemm_ops(CPU)


def _dequantized(operand) -> torch.Tensor:
    if isinstance(operand, Quantized):
        return operand.dequantize()
    codes, inverse_scale = operand  # FP8 codes for torch._scaled_mm and their inverse scale(s)
    return codes.to(torch.float32) * inverse_scale


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("recipe", LOW_PRECISION)
def test_the_benchmarks_quantizer_equals_the_training_quantizer_on_cpu(recipe, role):
    # The training quantizer is the one apply_recipe gives an emulated layer on this device; the benchmark's is
    # the recipe's GEMM format's (fp8_delayed: fp8_tensorwise, equal to delayed scaling before it has a history).
    impl = get_recipe(recipe)
    _, training, _ = impl.convert(nn.Linear(TENSOR_SHAPE[1], TENSOR_SHAPE[0], bias=False), "proj",
                                  impl.resolve_options({}), False)
    ops = get_recipe(catalog.get(recipe).gemm_format).gemm_ops(CPU)
    x = torch.randn(*TENSOR_SHAPE, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    torch.manual_seed(0)  # nvfp4's stochastic rounding of dY draws from the global generator, row layout first
    got = ops.quantizer(role)(x, LAYOUTS)
    torch.manual_seed(0)
    want = [getattr(training, TRAINING_OPERAND[(role, layout)])(x, dtype=gemm_dtype(x, training)) for layout in LAYOUTS]
    for layout, g, w in zip(LAYOUTS, got, want):
        assert torch.equal(_dequantized(g), w.dequantize()), (recipe, role, layout)
        if isinstance(g, Quantized):
            assert g.values.dtype == w.values.dtype and g.values.shape == w.values.shape


def test_emulated_formats_time_trainings_gemm_on_trainings_operands_in_quant_mode():
    result = run_gemm_benchmark(shapes="64x128x96", formats="mxfp8,nvfp4,fp8_blockwise", device="cpu",
                                repeats=1, warmup=0)
    assert result["failures"] == []
    for fmt in ("mxfp8", "nvfp4"):
        kernel, quant = (next(r for r in result["results"] if r["format"] == fmt and r["mode"] == mode)
                         for mode in ("kernel", "quant"))
        assert kernel["backend"] == quant["backend"] == "emulated" and quant["check"] == "pass"
        assert quant["gemm_s"] > 0 and quant["timing"] is not kernel["timing"]
        assert "training's quantizers" in quant["note"]
        assert quant["time_s"] == pytest.approx(quant["gemm_s"] + quant["quant_s"])


def test_gemm_bench_checks_its_output_before_timing_and_keeps_the_result_if_the_write_fails(tmp_path, capsys,
                                                                                             monkeypatch):
    """--output naming a folder was found after the benchmark had run (a traceback, the table lost); a write that
    fails after all leaves the result in a temporary file, the table printed."""
    from training.gemm import cli

    timed = []
    monkeypatch.setattr(cli, "run_gemm_benchmark", lambda *a, **k: timed.append(1) or {"failures": []})
    monkeypatch.setattr(cli, "format_table", lambda result: "THE TABLE")
    with pytest.raises(SystemExit) as stop:
        cli.main(["--shapes", "64x64x64", "--formats", "bf16", "--device", "cpu", "--output", str(tmp_path)])
    assert stop.value.code == 2 and timed == []
    assert f"--output {tmp_path}: {tmp_path} is a folder; give a file name" in capsys.readouterr().err
    target = tmp_path / "r.json"
    monkeypatch.setattr(type(target), "write_text", lambda self, text: (_ for _ in ()).throw(OSError("disk full")))
    assert cli.main(["--shapes", "64x64x64", "--formats", "bf16", "--device", "cpu", "--output", str(target)]) == 0
    out, err = capsys.readouterr()
    assert "THE TABLE" in out and f"could not write {target} (disk full); the result is in " in err
