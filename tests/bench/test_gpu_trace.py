"""train_bench keeps the NVML samples of the timed window beside each timed step's log time, so a slow step can be
set against the clock and the reason NVML gives for it (e.g. the power cap)."""
from types import SimpleNamespace


def test_the_trace_holds_the_timed_windows_samples_on_the_steps_clock(bench):
    sampler = bench.GpuSampler.__new__(bench.GpuSampler)  # no NVML here: samples filled by hand
    sampler.samples = [(9.0, 1980, 300.0, 40, 100, 0), (10.05, 1980, 690.0, 50, 100, 0),
                       (10.95, 1650, 699.5, 55, 100, 4), (12.0, 1980, 500.0, 55, 100, 0)]
    sink = SimpleNamespace(log_at={7: 10.0, 8: 10.5, 9: 11.0})
    trace = bench._gpu_trace(sampler, sink, [7, 8, 9])["gpu_trace"]
    assert trace["step_logged_s"] == [0.0, 0.5, 1.0]
    assert trace["samples_s_mhz_w_reasons"] == [[0.05, 1980, 690.0, 0], [0.95, 1650, 699.5, 4]]


def test_no_trace_without_a_sampler_or_timed_steps(bench):
    sink = SimpleNamespace(log_at={})
    assert bench._gpu_trace(None, sink, [1]) == {}
    assert bench._gpu_trace(SimpleNamespace(), sink, []) == {}
