"""MetricsDrain on CPU: per-step metrics, step timing on the host clock, divergence, the summary."""
import math
import time

import pytest
import torch

from training.checkpoint import TrainState
from training.metrics_drain import MetricsDrain, StepRecord
from training.sink import ListSink

TOKENS_PER_STEP, FLOPS_PER_TOKEN = 1000, 6e6


def drain_on_cpu(sink=None, state=None) -> MetricsDrain:
    return MetricsDrain(sink if sink is not None else ListSink(), state if state is not None else TrainState(),
                        device=torch.device("cpu"), device_name="cpu", lag=2, tokens_per_step=TOKENS_PER_STEP,
                        flops_per_token=FLOPS_PER_TOKEN)


def push(drain, step, loss, *, host_end, grad_norm=1.0, data_wait=0.0):
    drain.push(step, torch.tensor(loss), torch.tensor(grad_norm),
               StepRecord(lr=1e-3 * step, tokens=step * TOKENS_PER_STEP, wall=10.0 + step, data_wait=data_wait,
                          host_end=host_end, host_issue=0.01))


def test_each_step_is_logged_with_its_host_time_since_the_previous_step():
    sink, state = ListSink(), TrainState()
    drain = drain_on_cpu(sink, state)
    drain.start_clock(100.0)
    push(drain, 1, 5.0, host_end=100.5, grad_norm=2.0, data_wait=0.1)
    push(drain, 2, 4.5, host_end=100.75)
    drain.poll()
    assert [p["step"] for p in sink.points] == [1, 2]
    first = sink.points[0]
    assert (first["tokens"], first["wall_time"]) == (1000, 11.0)
    m = first["metrics"]
    assert (m["train/loss"], m["train/lr"], m["train/grad_norm"]) == (5.0, 1e-3, 2.0)
    assert m["perf/step_time_s"] == pytest.approx(0.5) and m["perf/tokens_per_s"] == pytest.approx(2000.0)
    assert m["perf/tflops"] == pytest.approx(FLOPS_PER_TOKEN * 2000.0 / 1e12)
    assert (m["perf/data_wait_s"], m["perf/host_issue_s"]) == (0.1, 0.01)
    assert "perf/mfu" not in m and "perf/peak_mem_gib" not in m  # no peak figures for a CPU
    assert sink.points[1]["metrics"]["perf/step_time_s"] == pytest.approx(0.25)
    assert state.loss == 4.5 and not drain.diverged and drain.pending == type(drain.pending)()


def test_time_spent_between_steps_is_not_booked_after_a_clock_restart():
    sink = ListSink()
    drain = drain_on_cpu(sink)
    drain.start_clock(0.0)
    drain.restart_clock()  # e.g. after a validation that took since t=0
    push(drain, 1, 5.0, host_end=time.perf_counter() + 0.5)
    drain.flush()
    assert 0.5 <= sink.series("perf/step_time_s")[0][1] < 1.0


def test_a_non_finite_loss_stops_logging_at_that_step():
    sink, state = ListSink(), TrainState()
    drain = drain_on_cpu(sink, state)
    drain.start_clock(0.0)
    push(drain, 1, 5.0, host_end=1.0)
    push(drain, 2, float("nan"), host_end=2.0)
    push(drain, 3, 4.0, host_end=3.0)  # issued before the divergence was seen (GPU: `lag` steps late)
    drain.poll()
    assert drain.diverged and drain.diverged_step == 2
    losses = sink.series("train/loss")
    assert [s for s, _ in losses] == [1, 2] and math.isnan(losses[1][1])
    assert sink.points[1]["metrics"].keys() == {"train/loss"}  # no rates for a diverged step
    assert state.loss == 5.0 and drain.step_times == [1.0]
    push(drain, 4, 3.0, host_end=4.0)
    drain.flush()
    assert len(sink.points) == 2 and drain.diverged_step == 2


def test_summary_takes_medians_past_the_first_two_steps():
    drain = drain_on_cpu()
    assert drain.summary() == {}
    drain.start_clock(0.0)
    for step, end in enumerate([10.0, 20.0, 21.0, 23.0, 26.0], start=1):  # step times 10, 10, 1, 2, 3
        push(drain, step, 5.0, host_end=end, data_wait=0.5)
    drain.flush()
    summary = drain.summary()
    assert summary["step_time_s"] == 2.0 and summary["tokens_per_s"] == TOKENS_PER_STEP / 2.0
    assert summary["data_wait_share"] == pytest.approx(1.5 / 6.0)
    assert summary["tflops"] == pytest.approx(FLOPS_PER_TOKEN * 500.0 / 1e12) and summary["mfu"] is None
    assert summary["tokens_per_s_per_gpu"] == summary["tokens_per_s"] and summary["tflops_per_gpu"] == summary["tflops"]


def test_summary_totals_are_over_every_process_and_per_gpu_figures_divide_them():
    drain = MetricsDrain(ListSink(), TrainState(), device=torch.device("cpu"), device_name="NVIDIA H100 80GB HBM3",
                         lag=2, tokens_per_step=TOKENS_PER_STEP, flops_per_token=FLOPS_PER_TOKEN, world=4)
    drain.start_clock(0.0)
    for step in range(1, 6):
        push(drain, step, 5.0, host_end=float(step))   # 1 s a step: 1000 tokens/s over the 4 processes
    drain.flush()
    summary = drain.summary()
    assert summary["tokens_per_s"] == 1000.0 and summary["tokens_per_s_per_gpu"] == 250.0
    assert summary["tflops_per_gpu"] == pytest.approx(summary["tflops"] / 4)
    assert summary["mfu"] == pytest.approx(FLOPS_PER_TOKEN * 1000.0 / (4 * 989.4e12))
