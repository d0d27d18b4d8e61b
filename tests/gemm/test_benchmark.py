"""The benchmark on CPU: timings labelled CPU, every low-precision result checked against BF16, the
result posted as JSON, bad arguments refused with a message."""
import json

import pytest
import torch

import training.gemm.formats as formats
from training.gemm import ERROR_BOUNDS, FORMATS, main, predict_speedup, run_gemm_benchmark
from training.gemm.formats import EMULATED_LABEL
from training.gemm.timing import time_gemm


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemm") / "result.json"
    posted = []
    rc = main(["--shapes", "64x128x96,128x256x128", "--device", "cpu", "--repeats", "2", "--warmup", "1",
               "--output", str(out)], post_result=posted.append)
    return rc, posted, out


def test_cli_runs_on_cpu_labels_timings_cpu_and_posts_the_json(cli_run):
    rc, posted, out = cli_run
    assert rc == 0
    assert len(posted) == 1
    result = posted[0]
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["device"]["type"] == "cpu" and result["device"]["timer"] == "CPU"
    timed = [r for r in result["results"] if r["time_s"]]
    assert timed and all(r["timing"]["timer"] == "CPU" for r in timed)
    assert {"torch", "torchao"} <= set(result["versions"]) and "commit" in result["git"]
    assert result["formats"] == list(FORMATS) and result["modes"] == ["kernel", "quant"]


def test_every_low_precision_result_is_checked_against_bf16_within_its_bound(cli_run):
    result = cli_run[1][0]
    checked = [r for r in result["results"] if r["format"] != "bf16" and r["check"] != "unsupported"]
    assert {r["format"] for r in checked} == set(FORMATS) - {"bf16"}
    for r in checked:
        assert r["check"] == "pass", r
        assert 0 < r["rel_error"] <= ERROR_BOUNDS[r["format"]]
    assert result["failures"] == []


def test_formats_without_cpu_kernels_are_labelled_emulated(cli_run):
    result = cli_run[1][0]
    for r in result["results"]:
        if r["format"] in ("mxfp8", "nvfp4", "fp8_blockwise") and r["time_s"]:
            assert r["backend"] == "emulated" and EMULATED_LABEL in r["note"]


def test_unsupported_shape_is_reported_and_charged_at_bf16_time(cli_run):
    result = cli_run[1][0]
    # 64x128x96 is not a multiple of 128: the blockwise recipe cannot run it, training keeps it in BF16.
    skipped = [r for r in result["results"] if r["format"] == "fp8_blockwise" and r["m"] == 64]
    assert skipped and all(r["check"] == "unsupported" and "divisible by 128" in r["note"] for r in skipped)
    totals = result["totals"]["kernel"]["fp8_blockwise"]
    assert totals["bf16_fallback"] == ["custom.fprop 64x128x96"]
    bf16 = {(r["m"], r["k"], r["n"]): r["time_s"] for r in result["results"] if r["format"] == "bf16"}
    blockwise_128 = next(r for r in result["results"] if r["format"] == "fp8_blockwise"
                         and r["mode"] == "kernel" and r["m"] == 128)
    assert totals["total_s"] == pytest.approx(bf16[(64, 128, 96)] + blockwise_128["time_s"])


def test_gemm_only_prediction_when_no_step_time_is_given(cli_run):
    result = cli_run[1][0]
    pred = result["prediction"]["kernel"]["fp8_tensorwise"]
    t = result["totals"]["kernel"]
    assert pred["basis"] == "GEMM-only"
    assert pred["speedup"] == pytest.approx(t["bf16"]["total_s"] / t["fp8_tensorwise"]["total_s"])


def test_a_quantizer_that_misapplies_its_scale_fails_the_check(monkeypatch):
    good = formats.fp8_tensorwise_quantize

    def scale_not_inverted(x, dtype):  # hands the GEMM the scale instead of its inverse
        q, inv_scale = good(x, dtype)
        return q, inv_scale.reciprocal()
    monkeypatch.setattr(formats, "fp8_tensorwise_quantize", scale_not_inverted)
    result = run_gemm_benchmark(shapes="64x128x96", formats="bf16,fp8_tensorwise", device="cpu",
                                repeats=1, warmup=0)
    recs = [r for r in result["results"] if r["format"] == "fp8_tensorwise"]
    assert [r["check"] for r in recs] == ["fail", "fail"]
    assert len(result["failures"]) == 2 and "relative error" in result["failures"][0]


def test_a_too_coarse_emulation_quantizer_fails_the_nvfp4_bound(monkeypatch):
    # One bit per element (sign × block max) instead of E2M1: relative error ≈ 0.6 > 0.25.
    def sign_only(x, fmt, block_size=None):
        x = x.contiguous()
        return torch.sign(x) * x.abs().reshape(x.shape[0], -1, 16).amax(-1, keepdim=True).expand(
            -1, -1, 16).reshape(x.shape)
    monkeypatch.setattr(formats, "emulation_quantize_dequantize", sign_only)
    posted = []
    rc = main(["--shapes", "64x128x96", "--formats", "nvfp4", "--mode", "quant", "--device", "cpu",
               "--repeats", "1"], post_result=posted.append)
    assert rc == 1
    rec = next(r for r in posted[0]["results"] if r["format"] == "nvfp4")
    assert rec["check"] == "fail" and rec["rel_error"] > ERROR_BOUNDS["nvfp4"]


def test_amdahl_prediction_uses_the_gemm_share_of_the_measured_step():
    pred = predict_speedup(0.6, 0.3, bf16_step_s=1.0)  # step 1.0 s → 0.4 + 0.3 = 0.7 s
    assert pred["basis"] == "amdahl" and pred["gemm_share"] == pytest.approx(0.6)
    assert pred["speedup"] == pytest.approx(1 / 0.7) and pred["gemm_speedup"] == pytest.approx(2.0)
    assert predict_speedup(0.6, 0.3)["basis"] == "GEMM-only"
    invalid = predict_speedup(2.0, 1.0, bf16_step_s=1.0)
    assert invalid["basis"] == "invalid" and invalid["speedup"] is None and "exceeds" in invalid["note"]


def test_model_preset_with_step_time_gives_amdahl_prediction():
    result = run_gemm_benchmark("tiny", micro_batch=1, seq_len=32, vocab_size=256,
                                formats=["fp8_tensorwise"], modes=["kernel"], device="cpu", repeats=1,
                                warmup=0, bf16_step_time_s=10.0)
    assert result["config"]["dims"]["vocab_size"] == 256 and len(result["shapes"]) == 15
    assert result["prediction"]["kernel"]["fp8_tensorwise"]["basis"] == "amdahl"


def test_timing_rotates_buffers_and_takes_the_median():
    calls = []
    timing = time_gemm(calls.append, 3, torch.device("cpu"), warmup=2, repeats=5)
    assert calls == [0, 1, 0, 1, 2, 0, 1]
    assert timing["timer"] == "CPU" and timing["repeats"] == 5 and timing["min_s"] <= timing["median_s"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "7b"], "--model must be one of tiny, 125m, 350m, 1b or a JSON object"),
    (["--model", "{bad json"], "--model JSON does not parse"),
    (["--model", '{"hidden_size": 64}'], "lacks intermediate_size"),
    (["--shapes", "64x128"], "write M x K x N"),
    (["--shapes", "64x128x96", "--formats", "fp8,bf16"], "unknown format ['fp8']"),
    (["--shapes", "64x128x96", "--mode", "fast"], "invalid choice: 'fast'"),
    (["--shapes", "64x128x96", "--model", "tiny"], "exactly one of --model"),
    ([], "exactly one of --model"),
    (["--model", "tiny", "--micro-batch", "0"], "expected a positive integer, got 0"),
    (["--shapes", "64x128x96", "--no-gqa"], "do not apply to --shapes"),
    (["--shapes", "64x128x96", "--bf16-step-time", "-1"], "expected positive seconds"),
    (["--shapes", "64x128x96", "--device", "tpu"], "device must be auto, cpu, cuda"),
])
def test_bad_arguments_exit_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_compiled_quantize_and_gemm_equals_the_eager_one():
    # On CUDA, quant mode times fp8_quant_gemm under torch.compile(dynamic=True): it must trace (with
    # transposed operands, E5M2 gradients and rowwise scales) and give the eager bits.
    compiled = torch.compile(formats.fp8_quant_gemm, dynamic=True)
    for tensorwise_grad, rowwise in ((True, False), (False, True)):
        a = torch.randn(128, 64, dtype=torch.bfloat16).t()  # wgrad-like: A is a transposed view
        bt = torch.randn(96, 128, dtype=torch.bfloat16)
        dtype = torch.float8_e5m2 if tensorwise_grad else torch.float8_e4m3fn
        assert torch.equal(compiled(a, bt, dtype, rowwise, False), formats.fp8_quant_gemm(a, bt, dtype, rowwise, False))


def test_result_carries_the_request_that_reproduces_it():
    first = run_gemm_benchmark("tiny", micro_batch=1, seq_len=16, vocab_size=128, formats="fp8_rowwise",
                               modes="kernel", device="cpu", repeats=1, warmup=0, gated_mlp=False)
    again = run_gemm_benchmark(**json.loads(json.dumps(first["request"])))
    assert again["shapes"] == first["shapes"] and again["config"] == first["config"]
    assert again["formats"] == ["bf16", "fp8_rowwise"] and again["modes"] == ["kernel"]
