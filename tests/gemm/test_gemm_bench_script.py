"""bench/gemm_bench.py, the GEMM benchmark's one-GPU acceptance run, checked on CPU with --smoke: the JSON it writes, the
interleaved tool-vs-raw comparison of part (a), and the prediction-vs-training comparison of part (b)."""
import importlib
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TRAIN_BENCH_H200 = REPO / "bench" / "results" / "train_bench_2026-11-22T0240_NVIDIA_H200_recipes.json"


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("bench.gemm_bench")


@pytest.fixture(scope="module")
def smoke(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    mp = pytest.MonkeyPatch()
    mp.setenv("OUT", str(out))
    mp.setenv("PLAB_GIT_COMMIT", "abc1234")
    mkldnn_before = torch.backends.mkldnn.enabled
    try:
        rc = bench.main(["--smoke", "--rounds", "2", "--repeats", "1", "--step-times", "bf16=0.5,fp8_tensorwise=0.45"])
    finally:
        mp.undo()
    # The smoke run turns oneDNN off while it measures on a CPU (its FP8 matmul is the slow reference); the
    # process it runs in gets the flag back.
    assert torch.backends.mkldnn.enabled == mkldnn_before
    files = list(out.glob("gemm_bench_smoke_*.json"))
    assert len(files) == 1
    return rc, json.loads(files[0].read_text())


def test_smoke_run_writes_the_json_with_device_date_and_commit(smoke):
    rc, report = smoke
    assert rc == 0 and report["errors"] == {}
    assert report["git"]["commit"] == "abc1234" and report["device"] and report["created_at"]
    assert {"a", "b", "c", "c_vs_te"} <= set(report) and set(report["part_wall_s"]) == {"a", "b", "c"}
    assert report["b"]["formats"] == ["bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4"]
    assert report["b"]["modes"] == ["kernel", "quant"]


def test_part_a_interleaves_protocol_and_operands_and_compares_like_with_like(smoke):
    rows = smoke[1]["a"]["rows"]
    assert [r["format"] for r in rows] == ["bf16", "fp8_tensorwise"]
    for r in rows:
        cells = r["tflops_median"]
        assert set(cells) == {f"{p}|{o}" for p in ("tool_protocol", "do_bench") for o in ("tool_operands", "raw_operands")}
        assert all(len(v) == 2 for v in r["tflops_per_round"].values())
        assert r["acceptance_ratio"] == pytest.approx(cells["tool_protocol|tool_operands"] / cells["do_bench|tool_operands"])
        assert r["ratio_as_reported"] == pytest.approx(cells["tool_protocol|tool_operands"] / cells["do_bench|raw_operands"])
        # The two factors multiply back to the reported ratio (geometric means over the other factor).
        assert r["protocol_factor"] * r["operand_factor"] == pytest.approx(r["ratio_as_reported"])
        assert r["within_5pct"] == (abs(r["acceptance_ratio"] - 1) <= 0.05
                                    and abs(r["acceptance_ratio_raw_operands"] - 1) <= 0.05)
    fp8 = rows[1]["checks"]
    assert fp8["tool_fp8_rel_error_vs_bf16"] < 0.1 and fp8["raw_fp8_rel_error_vs_bf16"] < 0.1


def test_part_b_puts_measured_speedups_next_to_both_predictions(smoke):
    report = smoke[1]
    (row,) = report["b_vs_training"]
    assert row["recipe"] == "fp8_tensorwise" and row["measured_speedup"] == pytest.approx(0.5 / 0.45)
    pred = report["b"]["prediction"]
    assert row["predicted_quant"] == pred["quant"]["fp8_tensorwise"]["speedup"]
    assert row["predicted_kernel"] == pred["kernel"]["fp8_tensorwise"]["speedup"]
    assert row["within_0.10"] == (abs(row["predicted_quant"] - row["measured_speedup"]) <= 0.10)
    assert pred["quant"]["fp8_tensorwise"]["bf16_step_s"] == 0.5


def test_step_times_from_a_train_bench_result(bench):
    times, device = bench.step_times_from_train_bench(TRAIN_BENCH_H200)
    assert device == "NVIDIA H200"
    assert times["bf16"] == pytest.approx(0.1314, abs=1e-4) and times["fp8_tensorwise"] == pytest.approx(0.1136, abs=1e-4)


@pytest.mark.parametrize("text, message", [
    ("fp8_tensorwise=0.1", "needs bf16=<seconds>"),
    ("bf16=abc", "write recipe=seconds"),
    ("bf16=-1", "positive seconds"),
])
def test_bad_step_times_are_refused(bench, text, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_step_times(text)


def test_bad_arguments_exit_with_a_message(bench, capsys, tmp_path):
    for argv, message in ((["--smoke", "--parts", "a,d"], "--parts must be a subset"),
                          (["--smoke", "--rounds", "0"], "--rounds must be >= 1"),
                          (["--smoke", "--train-bench", str(tmp_path / "none.json")], "cannot read it as JSON"),
                          (["--smoke", "--step-times", "bf16=1", "--bf16-step-time", "2"], "disagrees")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err
