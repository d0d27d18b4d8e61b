"""The benchmark on CPU: timings labelled CPU, every low-precision result checked against BF16, the
result posted as JSON, bad arguments refused with a message."""
import json

import pytest
import torch

import training.precision.fp8_tensorwise as fp8_ops
import training.precision.nvfp4 as nvfp4
from training.gemm import (ERROR_BOUNDS, FORMATS, GemmShape, gemm_shapes, main, parse_shapes, predict_speedup,
                           run_gemm_benchmark)
from training.gemm.formats import EMULATED_LABEL
from training.gemm.predict import aggregate, predictions
from training.gemm.quantization import attributed_quant_s, readers, step_tensors
from training.gemm.timing import time_gemm
from training.precision.formats import Quantized


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
    good = fp8_ops.fp8_quantize_layouts

    def scale_not_inverted(x, dtype, rowwise, layouts):  # hands the GEMM the scale instead of its inverse
        return tuple((q, inv_scale.reciprocal()) for q, inv_scale in good(x, dtype, rowwise, layouts))
    monkeypatch.setattr(fp8_ops, "fp8_quantize_layouts", scale_not_inverted)
    result = run_gemm_benchmark(shapes="64x128x96", formats="bf16,fp8_tensorwise", device="cpu",
                                repeats=1, warmup=0)
    recs = [r for r in result["results"] if r["format"] == "fp8_tensorwise"]
    assert [(r["mode"], r["check"]) for r in recs] == [("kernel", "fail"), ("quant", "fail")]
    assert len(result["failures"]) == 2 and "relative error" in result["failures"][0]


def test_the_transposed_layout_feeds_exactly_dgrad_and_wgrad(monkeypatch):
    # Break only the transposed cast: fprop (X, W as stored) must pass, dgrad (Wᵀ) and wgrad (dYᵀ, Xᵀ) fail.
    good = fp8_ops.fp8_quantize_layouts

    def broken_transpose(x, dtype, rowwise, layouts):
        out = good(x, dtype, rowwise, layouts)
        return tuple((q.flip(0) if lay == "t" else q, s) for (q, s), lay in zip(out, layouts))
    monkeypatch.setattr(fp8_ops, "fp8_quantize_layouts", broken_transpose)
    result = run_gemm_benchmark("tiny", micro_batch=1, seq_len=64, vocab_size=128, formats="fp8_tensorwise",
                                device="cpu", repeats=1, warmup=0)
    checks = {(r["layer"], r["gemm"], r["mode"]): r["check"] for r in result["results"] if r["format"] != "bf16"}
    assert checks and all(c == ("pass" if g == "fprop" else "fail") for (_, g, _), c in checks.items())


def _coarse_nvfp4(x, *, dtype=torch.float32, **_):
    """One bit per element (sign × tensor max) instead of E2M1: relative error ≈ 1 > 0.25."""
    return Quantized((torch.sign(x) * x.abs().amax()).to(dtype))


def test_a_too_coarse_training_quantizer_fails_the_nvfp4_bound(monkeypatch):
    # Quant mode checks the GEMM on the operands of the quantizers a training step runs.
    monkeypatch.setattr(nvfp4, "quantize_nvfp4", _coarse_nvfp4)
    posted = []
    rc = main(["--shapes", "64x128x96", "--formats", "nvfp4", "--mode", "quant", "--device", "cpu",
               "--repeats", "1"], post_result=posted.append)
    assert rc == 1
    rec = next(r for r in posted[0]["results"] if r["format"] == "nvfp4")
    assert rec["mode"] == "quant" and rec["check"] == "fail" and rec["rel_error"] > ERROR_BOUNDS["nvfp4"]


def test_amdahl_prediction_uses_the_gemm_share_of_the_measured_step():
    pred = predict_speedup(0.6, 0.3, bf16_step_s=1.0)  # step 1.0 s → 0.4 + 0.3 = 0.7 s
    assert pred["basis"] == "amdahl" and pred["gemm_share"] == pytest.approx(0.6)
    assert pred["speedup"] == pytest.approx(1 / 0.7) and pred["gemm_speedup"] == pytest.approx(2.0)
    assert predict_speedup(0.6, 0.3)["basis"] == "GEMM-only"
    invalid = predict_speedup(2.0, 1.0, bf16_step_s=1.0)
    assert invalid["basis"] == "invalid" and invalid["speedup"] is None and "exceeds" in invalid["note"]


def test_amdahl_prediction_adds_the_quantization_time():
    # (S − G_bf16) + G_fmt + Q = (1.0 − 0.6) + 0.3 + 0.1 = 0.8 s
    pred = predict_speedup(0.6, 0.3, bf16_step_s=1.0, quant_s=0.1)
    assert pred["predicted_step_s"] == pytest.approx(0.8) and pred["speedup"] == pytest.approx(1.25)
    assert pred["gemm_speedup"] == pytest.approx(1.5) and pred["quant_s"] == 0.1
    with pytest.raises(ValueError, match="quantization time must be >= 0"):
        predict_speedup(0.6, 0.3, 1.0, quant_s=-0.1)


def _rec(layer, gemm, fmt, mode, gemm_s, quant_s=0.0, count=2):
    return {"layer": layer, "gemm": gemm, "m": 8, "k": 8, "n": 8, "count": count, "format": fmt, "mode": mode,
            "time_s": gemm_s + quant_s, "gemm_s": gemm_s, "quant_s": quant_s}


def test_totals_split_gemm_and_quantization_and_predictions_keep_the_lm_head_in_bf16():
    records = [_rec("qkv", "fprop", "bf16", "both", 4.0), _rec("lm_head", "fprop", "bf16", "both", 3.0, count=1),
               _rec("qkv", "fprop", "fp8_tensorwise", "kernel", 2.0), _rec("lm_head", "fprop", "fp8_tensorwise", "kernel", 1.0, count=1),
               _rec("qkv", "fprop", "fp8_tensorwise", "quant", 2.0, 0.5),
               _rec("lm_head", "fprop", "fp8_tensorwise", "quant", 1.0, 0.25, count=1)]
    totals = aggregate(records, ["bf16", "fp8_tensorwise"], ["kernel", "quant"])
    q = totals["quant"]["fp8_tensorwise"]
    assert (q["gemm_s"], q["quant_s"], q["total_s"]) == (5.0, 1.25, 6.25)  # every layer in FP8
    assert q["per_layer_s"] == {"qkv": 5.0, "lm_head": 1.25}
    # Training keeps the LM head in BF16: 2·2.0 + 2·0.5 for qkv, 3.0 (BF16, unquantized) for lm_head.
    assert q["training"] == {"gemm_s": 7.0, "quant_s": 1.0, "total_s": 8.0, "speedup": 11.0 / 8.0,
                             "bf16_layers": ["lm_head"]}
    assert totals["kernel"]["bf16"]["training"]["bf16_layers"] == []
    pred = predictions(totals, bf16_step_s=20.0)
    # (20 − 11) + 7 + 1 = 17 s with quantization; (20 − 11) + 7 = 16 s kernel-only.
    assert pred["quant"]["fp8_tensorwise"]["speedup"] == pytest.approx(20 / 17)
    assert pred["kernel"]["fp8_tensorwise"]["speedup"] == pytest.approx(20 / 16)
    assert "upper bound" in pred["kernel"]["fp8_tensorwise"]["label"]
    assert "expected" in pred["quant"]["fp8_tensorwise"]["label"]


@pytest.fixture(scope="module")
def tiny_quant():
    # 32 tokens: CPU FP8 products are slow (torch 2.13 CPU _scaled_mm), and the test checks accounting, not speed.
    return run_gemm_benchmark("tiny", micro_batch=1, seq_len=32, vocab_size=256, formats="fp8_tensorwise,fp8_rowwise",
                              modes="quant", device="cpu", repeats=2, warmup=0, bf16_step_time_s=5.0)


def test_quant_mode_counts_each_step_tensor_once_with_its_multiplicity(tiny_quant):
    result = tiny_quant
    assert [r for r in result["results"] if r["mode"] == "kernel"] == []  # only the requested mode is listed
    for fmt in ("fp8_tensorwise", "fp8_rowwise"):
        tensors = [t for t in result["quantization"]["tensors"] if t["format"] == fmt]
        # 5 linear layers × (X, W, dY), each in both layouts, 4 decoder layers or 1 LM head per step.
        assert len(tensors) == 15 and all(t["layouts"] == ["row", "t"] for t in tensors)
        assert {t["count"] for t in tensors if t["group"] != "lm_head"} == {4}
        per_step = sum(t["count"] * t["time_s"] for t in tensors)
        totals = result["totals"]["quant"][fmt]
        assert totals["quant_s"] == pytest.approx(per_step)
        assert totals["training"]["quant_s"] == pytest.approx(
            per_step - sum(t["time_s"] for t in tensors if t["group"] == "lm_head"))
        # A GEMM's quant-mode time is its kernel time plus half of each of its two tensors' quantization.
        recs = {(r["layer"], r["gemm"]): r for r in result["results"] if r["format"] == fmt}
        by_name = {t["tensor"]: t["time_s"] for t in tensors}
        wgrad = recs[("mlp_up", "wgrad")]
        assert wgrad["quant_s"] == pytest.approx((by_name["mlp_up.dY"] + by_name["mlp_up.X"]) / 2)
        assert wgrad["time_s"] == pytest.approx(wgrad["gemm_s"] + wgrad["quant_s"])
        assert all(r["check"] == "pass" and r["time_s"] > r["gemm_s"] > 0 for r in recs.values())
    shared = {t["tensor"]: t["shared_with"] for t in result["quantization"]["tensors"] if t["format"] == "fp8_tensorwise"}
    # Same shape and E4M3 quantizer: timed once. dY (E5M2) of the same shape is timed on its own.
    assert shared["attn_out.X"] == "qkv.X" and shared["mlp_down.dY"] == "attn_out.dY"
    pred = result["prediction"]["quant"]["fp8_tensorwise"]
    t = result["totals"]["quant"]
    assert pred["predicted_step_s"] == pytest.approx(
        5.0 - t["bf16"]["total_s"] + t["fp8_tensorwise"]["training"]["gemm_s"] + t["fp8_tensorwise"]["training"]["quant_s"])


def test_step_tensors_of_the_1b_config_and_the_attribution_sums_to_the_per_tensor_total():
    shapes = gemm_shapes(dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                              num_key_value_heads=8, vocab_size=32000), 4, 2048)
    tensors, uses = step_tensors(shapes)
    dims = {t.name: (t.rows, t.cols, t.count, t.layouts) for t in tensors}
    assert dims["qkv.X"] == (8192, 2048, 16, ("row", "t")) and dims["qkv.W"] == (4096, 2048, 16, ("row", "t"))
    assert dims["mlp_up.dY"] == (8192, 16384, 16, ("row", "t")) and dims["mlp_down.X"] == (8192, 8192, 16, ("row", "t"))
    assert dims["lm_head.dY"] == (8192, 32000, 1, ("row", "t")) and len(tensors) == 15
    times = {i: 1e-3 * (i + 1) for i in range(len(tensors))}
    n_readers = readers(uses)
    attributed = sum(s.count * attributed_quant_s(pair, times, n_readers) for s, pair in zip(shapes, uses))
    assert attributed == pytest.approx(sum(t.count * times[i] for i, t in enumerate(tensors)))
    # A layer whose wgrad the format cannot run: X and dY are then needed in the row layout only.
    tensors, uses = step_tensors(shapes, supported=lambda s: s.gemm != "wgrad")
    assert all(t.layouts == (("row",) if t.role != "weight" else ("row", "t")) for t in tensors)
    assert all(u is None for s, u in zip(shapes, uses) if s.gemm == "wgrad")


def test_step_tensors_of_custom_gemms_and_inconsistent_layers():
    tensors, uses = step_tensors(parse_shapes("64x128x96,64x128x96"))
    assert [(t.name, t.rows, t.cols, t.layouts) for t in tensors] == [
        ("custom#0.X", 64, 128, ("row",)), ("custom#0.W", 96, 128, ("row",)),
        ("custom#1.X", 64, 128, ("row",)), ("custom#1.W", 96, 128, ("row",))]
    bad = [GemmShape("qkv", "fprop", 64, 32, 96, 2), GemmShape("qkv", "dgrad", 64, 96, 48, 2)]
    with pytest.raises(ValueError, match="disagrees with qkv.fprop"):
        step_tensors(bad)


def test_timing_rotates_buffers_and_takes_the_median():
    calls = []
    timing = time_gemm(calls.append, 3, torch.device("cpu"), warmup=2, repeats=5)
    assert calls == [0, 1, 0, 1, 2, 0, 1]
    assert timing["timer"] == "CPU" and timing["repeats"] == 5 and timing["min_s"] <= timing["median_s"]
    default = time_gemm(lambda i: None, 2, torch.device("cpu"), warmup=None, repeats=None)
    assert (default["warmup"], default["repeats"]) == (1, 3)
    with pytest.raises(ValueError, match="repeats must be None"):
        time_gemm(lambda i: None, 2, torch.device("cpu"), repeats=0)


def test_cuda_protocol_is_do_bench_s_flush_events_and_counts(monkeypatch):
    # The CUDA path's control flow, on a fake clock (no GPU here): one call, 5 flushed estimate calls,
    # 25 ms / estimate warm-up calls without flush, 100 ms / estimate timed calls each after a flush and
    # inside its own event pair - triton.testing.do_bench's schedule.
    import training.gemm.timing as timing
    log, clock = [], [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]
            log.append("event")

        def elapsed_time(self, end):
            return end.t - self.t

    class Flush:
        def zero_(self):
            log.append("flush")

    def run(i):
        clock[0] += 0.5  # ms
        log.append(i)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing, "flush_buffer", lambda device: Flush())
    out = timing.time_gemm(run, 2, torch.device("cuda"), warmup=None, repeats=None)
    assert (out["warmup"], out["repeats"], out["estimate_ms"]) == (50, 200, 0.5)
    assert out["median_s"] == pytest.approx(0.5e-3) and out["timer"] == "cuda_events" and "L2 flush" in out["protocol"]
    assert log[:13] == [0, "event", "flush", 1, "flush", 0, "flush", 1, "flush", 0, "flush", 1, "event"]
    warm = log[13:63]
    assert len(warm) == 50 and "flush" not in warm and "event" not in warm
    timed = log[63:]
    assert timed[:8] == ["flush", "event", 0, "event", "flush", "event", 1, "event"] and len(timed) == 4 * 200


@pytest.mark.slow
def test_compiled_training_cast_equals_the_eager_one():
    # On CUDA, quant mode times fp8_quantize_layouts under torch.compile(dynamic=False): it must trace
    # (both layouts, E5M2 gradients, rowwise scales) and give the eager bits.
    compiled = torch.compile(fp8_ops.fp8_quantize_layouts, dynamic=False)
    x = torch.randn(96, 64, dtype=torch.bfloat16)
    for dtype, rowwise in ((torch.float8_e5m2, False), (torch.float8_e4m3fn, True)):
        got, want = (compiled(x, dtype, rowwise, ("row", "t")),
                     fp8_ops.fp8_quantize_layouts(x, dtype, rowwise, ("row", "t")))
        for (q, s), (q_ref, s_ref), shape in zip(got, want, ((96, 64), (64, 96))):
            assert q.shape == shape and q.is_contiguous() and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
            assert torch.equal(s, s_ref)


@pytest.mark.parametrize("argv, message", [
    (["--model", "7b"], "--model must be one of tiny, 125m, 350m, 1b, a config.json (or its folder) or a JSON object"),
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


def test_result_carries_the_request_that_reproduces_it():
    first = run_gemm_benchmark("tiny", micro_batch=1, seq_len=16, vocab_size=128, formats="fp8_rowwise",
                               modes="kernel", device="cpu", repeats=1, warmup=0, gated_mlp=False)
    again = run_gemm_benchmark(**json.loads(json.dumps(first["request"])))
    assert again["shapes"] == first["shapes"] and again["config"] == first["config"]
    assert again["formats"] == ["bf16", "fp8_rowwise"] and again["modes"] == ["kernel"]
