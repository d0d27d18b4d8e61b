"""The train loop on CPU: learning, metrics, divergence, cancellation, the precision seam."""
import math

import pytest
import torch

from training.sink import JsonlSink, ListSink
from training.optim import lr_at
from training.train import TrainResult, train
from training.config import RunSpec
from training.devices import cpu_name

STEP_KEYS = {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s",
             "perf/data_wait_s", "perf/tflops"}


def test_tiny_model_learns_tinyshakespeare_in_50_steps(make_spec, cache_dir):
    sink = ListSink()
    spec = make_spec(training={"steps": 50, "batch_size": 8, "warmup_steps": 5, "val_every": 25})
    result = train(spec, sink, cache_dir=cache_dir)
    assert isinstance(result, TrainResult) and result.status == "succeeded"
    assert (result.steps, result.tokens) == (50, 50 * 8 * 32)
    losses = [v for _, v in sink.series("train/loss")]
    assert [s for s, _ in sink.series("train/loss")] == list(range(1, 51))  # every step, once
    assert math.log(512) - 0.3 < losses[0] < math.log(512) + 0.3         # starts near uniform
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0                          # and learns
    val = sink.series("val/loss")
    assert [s for s, _ in val] == [25, 50] and val[1][1] < val[0][1]
    assert result.final_val_loss == val[-1][1] and result.final_loss == losses[-1]
    # the baseline computes in FP32 on a CPU (FP32 parameters, no autocast): its GEMMs are called that, not BF16
    assert result.device_name == cpu_name() and result.gemm_backend == "fp32"
    assert result.summary["tokens_per_s"] > 0 and result.summary["mfu"] is None  # no peak for CPU


def test_every_step_reports_the_dashboard_metric_keys(make_spec, cache_dir):
    sink = ListSink()
    train(make_spec(training={"steps": 4, "warmup_steps": 2}), sink, cache_dir=cache_dir)
    for point in sink.points:
        if "train/loss" in point["metrics"]:
            assert STEP_KEYS <= set(point["metrics"])
            assert point["tokens"] == point["step"] * 4 * 32
    assert [p["metrics"]["train/lr"] for p in sink.points[:2]] == pytest.approx([1.5e-3, 3e-3])
    kinds = [e["kind"] for e in sink.events]
    # Data preparation reports its progress first (training.shards), then the model's conversion, the result last.
    first = kinds.index("conversion_report")
    assert set(kinds[:first]) <= {"data_progress"} and kinds[-1] == "result"
    assert sink.events[first]["report"]["recipe"] == "bf16"


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor(make_spec):
    spec = RunSpec.from_dict(make_spec(training={"steps": 110, "warmup_steps": 10, "lr": 1e-2,
                                                 "min_lr_ratio": 0.1}))
    assert lr_at(5, spec) == pytest.approx(5e-3)
    assert lr_at(10, spec) == pytest.approx(1e-2)
    assert lr_at(60, spec) == pytest.approx(1e-3 + 0.5 * 9e-3)
    assert lr_at(110, spec) == pytest.approx(1e-3)


def test_huge_learning_rate_diverges_with_the_step(make_spec, cache_dir):
    sink = ListSink()
    result = train(make_spec(training={"lr": 1e6, "warmup_steps": 0, "grad_clip": 0.0}), sink,
                   cache_dir=cache_dir)
    assert result.status == "diverged"
    # Which step first goes non-finite depends on the numerics of the installed torch (2-4 at lr=1e6); what
    # must hold: the run stops at that step, reports it, and every earlier loss was finite.
    losses = sink.series("train/loss")
    step = result.diverged_step
    assert 1 < step <= 6 and result.steps == step
    assert losses[-1][0] == step and not math.isfinite(losses[-1][1])
    assert all(math.isfinite(v) for _, v in losses[:-1]) and [s for s, _ in losses] == list(range(1, step + 1))


def test_should_stop_cancels_at_the_next_step_boundary(make_spec, cache_dir):
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) > 3
    sink = ListSink()
    result = train(make_spec(), sink, should_stop=should_stop, cache_dir=cache_dir)
    assert result.status == "cancelled" and result.steps == 3
    assert [s for s, _ in sink.series("train/loss")] == [1, 2, 3]


def test_jsonl_sink_writes_one_line_per_point_and_event(make_spec, cache_dir, tmp_path):
    import json
    sink = JsonlSink(tmp_path / "m.jsonl")
    train(make_spec(training={"steps": 3, "warmup_steps": 1}), sink, cache_dir=cache_dir)
    sink.close()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["type"] == "metrics" and "train/loss" in x["metrics"]] == [1, 2, 3]
    assert {x["kind"] for x in lines if x["type"] == "event"} >= {"conversion_report", "result"}


def test_recipe_numerics_are_sampled_only_on_numerics_every_steps(make_spec, cache_dir):
    sink = ListSink()
    result = train(make_spec(training={"steps": 6, "numerics_every": 3}, recipe="fp8_delayed",
                             bf16_last_layers=1), sink, cache_dir=cache_dir)
    assert result.status == "succeeded" and result.gemm_backend in ("real", "emulated")
    numerics_steps = {p["step"] for p in sink.points if any(k.startswith("numerics/") for k in p["metrics"])}
    assert numerics_steps == {3, 6}
    keys = {k for p in sink.points for k in p["metrics"] if k.startswith("numerics/")}
    assert all(k.count("/") == 2 for k in keys)             # numerics/<layer>/<stat>
    assert any(k.startswith("numerics/layers.0.") for k in keys)
    report = sink.events_of("conversion_report")[0]["report"]
    assert report["recipe"] == "fp8_delayed" and result.conversion_report == report["layers"]


def test_clipping_inside_the_fused_optimizer_trains_like_clip_grad_norm(make_spec, cache_dir):
    losses = {}
    for fused_clip in (True, False):
        sink = ListSink()
        # grad_clip 0.05 is far below the gradient norm of these first steps: every step is clipped.
        train(make_spec(training={"steps": 8, "grad_clip": 0.05, "perf": {"fused_clip": fused_clip}}), sink,
              cache_dir=cache_dir)
        losses[fused_clip] = [v for _, v in sink.series("train/loss")]
        norms = [v for _, v in sink.series("train/grad_norm")]
        assert min(norms) > 0.05
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)
    assert losses[True][-1] < losses[True][0]


@pytest.mark.parametrize("variant", [{"grad_accum": 2}, {"activation_checkpointing": True}])
def test_gradient_accumulation_and_activation_checkpointing_do_not_change_the_losses(make_spec, cache_dir,
                                                                                   variant):
    runs = {}
    for name, extra in (("plain", {}), ("variant", variant)):
        sink = ListSink()
        train(make_spec(training={"steps": 5, "batch_size": 8, **extra}), sink, cache_dir=cache_dir)
        runs[name] = [v for _, v in sink.series("train/loss")]
    assert runs["variant"] == pytest.approx(runs["plain"], abs=1e-5)


def test_a_multi_gpu_spec_outside_torchrun_says_how_to_launch_it(make_spec, cache_dir):
    from training.config import SpecError
    with pytest.raises(SpecError, match="torchrun --nproc-per-node 2"):
        train(make_spec(training={"gpus": 2}), cache_dir=cache_dir)


def test_should_stop_must_be_callable(make_spec, cache_dir):
    with pytest.raises(TypeError, match="should_stop must be a callable"):
        train(make_spec(), should_stop=True, cache_dir=cache_dir)


def test_random_corpus_trains_without_a_tokenizer_for_throughput_runs(make_spec, tmp_path):
    sink = ListSink()
    result = train(make_spec(data={"corpus": "random", "vocab_size": 256}, training={"steps": 3}), sink,
                   output_dir=tmp_path, cache_dir=tmp_path / "cache")
    assert result.status == "succeeded" and len(sink.series("train/loss")) == 3
    assert not (tmp_path / "cache").exists()   # nothing tokenized or cached
    assert not list((tmp_path / "checkpoints" / "step_00000003").glob("tokenizer*"))


def test_a_cpu_run_and_a_gemm_benchmark_on_this_machine_name_the_same_device():
    """The dashboard predicts a recipe's speedup from a GEMM benchmark only for runs on the device it was timed on
    (compared by name, as GPUs are): a CPU was "cpu" to the run, "cpu (N cores)" to the worker, "x86_64" to the
    benchmark."""
    from training.gemm.benchmark import _device_info
    from workers.jobs.train import device_name

    name = _device_info(torch.device("cpu"))["name"]
    assert name == cpu_name() == device_name() and name not in ("cpu", "")
