"""bench/step_profile.py's floor table: what each category of a training step must do, at given ceilings."""
import importlib

import pytest

from training.flops import matmul_params
from training.model import llama_config

CEILINGS = {"copy_gbps": 3000.0, "bf16_tflops": 800.0, "fp8_tflops": 1300.0}
PARAMS = 1_137_772_544  # the 1b preset with a 32000-token vocabulary
TOKENS = 4 * 2048


@pytest.fixture(scope="module")
def sp():
    return importlib.import_module("bench.step_profile")


@pytest.fixture(scope="module")
def config():
    return llama_config("1b", 32000, 2048)


def _floors(sp, config, recipe, **kw):
    return sp.step_floors(config, recipe, micro_batch=4, seq_len=2048, params=PARAMS, ceilings=CEILINGS, **kw)


def test_gemm_work_is_the_model_flop_formula_and_runs_at_the_bf16_peak(sp, config):
    f = _floors(sp, config, "bf16")["gemm"]
    assert f["work"] == 6 * matmul_params(config) * TOKENS  # training.flops, written independently
    assert f["floor_ms"] == pytest.approx(1e3 * f["work"] / 800e12)


def test_real_fp8_gemms_run_at_the_fp8_peak_except_the_lm_head(sp, config):
    head = 6 * config.hidden_size * config.vocab_size * TOKENS
    body = 6 * matmul_params(config) * TOKENS - head
    f = _floors(sp, config, "fp8_tensorwise", real_gemms=True)["gemm"]
    assert f["floor_ms"] == pytest.approx(1e3 * (body / 1300e12 + head / 800e12))
    # emulated formats run BF16 GEMMs
    assert _floors(sp, config, "mxfp8")["gemm"]["floor_ms"] == pytest.approx(1e3 * (body + head) / 800e12)


def test_optimizer_moves_28_bytes_per_parameter_plus_the_gradient_norm(sp, config):
    f = _floors(sp, config, "bf16")["optimizer"]
    assert f["work"] == 30 * PARAMS
    assert f["floor_ms"] == pytest.approx(30 * PARAMS / 3000e9 * 1e3)


def test_quantizer_bytes_follow_each_operand_and_the_recipe(sp, config):
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    hd = h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    # per layer: X into qkv, o, the (fused) gate/up and down; dY out of each; W of each (gate/up as one)
    x = TOKENS * (h + q + h + i)
    dy = TOKENS * ((q + 2 * kv) + h + 2 * i + h)
    w = h * (q + 2 * kv) + q * h + 2 * i * h + i * h
    for recipe, (act_b, w_b) in (("nvfp4", (8, 6)), ("mxfp8", (6, 6)), ("fp8_delayed", (4, 4))):
        f = _floors(sp, config, recipe)["quantizers"]
        assert f["work"] == pytest.approx(layers * (act_b * (x + dy) + w_b * w)), recipe
    assert "quantizers" not in _floors(sp, config, "bf16")
    # blocks kept in BF16 quantize nothing
    quarter = _floors(sp, config, "nvfp4", bf16_layers=layers // 4)["quantizers"]["work"]
    assert quarter == pytest.approx(0.75 * _floors(sp, config, "nvfp4")["quantizers"]["work"])


def test_floor_rows_give_measured_over_floor_and_a_total(sp, config):
    floors = _floors(sp, config, "bf16")
    measured = {"gemm": 2 * floors["gemm"]["floor_ms"], "optimizer": 20.0, "copy/cast": 5.0, "other": 1.0}
    rows = {r["category"]: r for r in sp.floor_rows(floors, measured)}
    assert rows["gemm"]["ratio"] == pytest.approx(2.0)
    assert rows["copy/cast"]["ratio"] is None and rows["other"]["floor_ms"] is None  # no floor to divide by
    assert rows["attention"]["measured_ms"] is None
    assert rows["total"]["measured_ms"] == pytest.approx(sum(measured.values()))
    assert rows["total"]["floor_ms"] == pytest.approx(sum(f["floor_ms"] for f in floors.values()))
    table = sp.format_floor_table("bf16", list(rows.values()))
    assert all(cat in table for cat in rows)
    assert "optimizer, unprofiled" not in rows  # only where the steps were also timed without the profiler
    timed = {r["category"]: r for r in sp.floor_rows(floors, measured, {"step_ms": 120.0, "optimizer_ms": 12.0})}
    assert timed["optimizer, unprofiled"]["ratio"] == pytest.approx(12.0 / floors["optimizer"]["floor_ms"])
    assert timed["step, unprofiled"]["ratio"] == pytest.approx(120.0 / rows["total"]["floor_ms"])
    assert timed["total"] == rows["total"]  # the profiled sum is not changed by them
    only_step = {r["category"] for r in sp.floor_rows(floors, measured, {"step_ms": 120.0, "optimizer_ms": None})}
    assert "step, unprofiled" in only_step and "optimizer, unprofiled" not in only_step  # overlapped update


@pytest.mark.parametrize("name,category", [
    ("_adamw_master_kernel", "optimizer"), ("_mxfp8_dual_quant_kernel", "quantizers"),
    ("_nvfp4_dual_amax_kernel", "quantizers"), ("triton_poi_fused__to_copy_clamp_mul_0", "quantizers"),
    ("_nvfp4_swiglu_kernel", "triton/elementwise"), ("_swiglu_fp8_kernel", "quantizers"),
    ("triton_red_fused__log_softmax_0", "triton/elementwise"), ("triton_poi_fused__to_copy_0", "copy/cast"),
    ("triton_per_fused__to_copy__unsafe_view_add_div_expand_mul_pow_sum_view_3", "triton/elementwise")])
def test_kernels_are_categorised_by_name(sp, name, category):
    assert sp.categorize(name) == category


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _Evt:
    def __init__(self, key, us, start=0.0, count=1):
        self.key, self.device_time_total, self.device_type = key, us, "DeviceType.CUDA"
        self.time_range = _Range(start, start + us)
        self.count = count


class _Prof:
    def __init__(self, evts):
        self.evts = evts

    def key_averages(self):
        return self.evts

    def events(self):
        return self.evts


def test_summary_sums_categories_per_step_and_counts_inductor_casts_named_after_a_gemm(sp):
    evts = [_Evt("nvjet_sm90_tst_128x128_TNT", 4000, 0, count=6),
            _Evt("triton_red_fused__scaled_mm_abs_amax_0", 1000, 4000),
            _Evt("triton_tem_fused__scaled_mm_1", 500, 5000), _Evt("_adamw_master_kernel", 1500, 8000)]
    out = sp.summarize(_Prof(evts), active=2)
    assert out["ms_per_step"] == {"gemm": 2.75, "optimizer": 0.75}
    assert out["gemm_fused_casts_ms"] == 0.5          # the triton_red_ kernel only, not the GEMM template
    assert out["gpu_busy_ms_per_step"] == 3.5 and out["gpu_span_ms_per_step"] == 4.75  # a 2.5 ms gap at 5.5-8 ms
    assert [name for _, name, _ in out["top"]][0] == "nvjet_sm90_tst_128x128_TNT"
    assert out["top_calls_per_step"]["nvjet_sm90_tst_128x128_TNT"] == 3  # 6 launches over the 2 active steps


def test_launch_grids_count_each_fused_quantizer_launch_per_grid_and_step(sp):
    k = {"cat": "kernel", "args": {"grid": [512, 16, 1]}, "dur": 200.0}
    events = [{**k, "name": "_nvfp4_dual_quant_kernel"}, {**k, "name": "_nvfp4_dual_quant_kernel"},
              {**k, "name": "_nvfp4_dual_quant_kernel", "args": {"grid": [512, 64, 1]}},
              {**k, "name": "nvjet_sm90_tst_256x128"},  # a GEMM: not a quantizer
              {"cat": "cpu_op", "name": "_nvfp4_dual_quant_kernel", "dur": 5.0}]  # the host side: not counted
    grids = sp.launch_grids(events, active=2)
    assert grids == {"_nvfp4_dual_quant_kernel": {"512x16x1": {"launches": 1.0, "ms": 0.2},
                                                  "512x64x1": {"launches": 0.5, "ms": 0.1}}}


def test_idle_gaps_sum_the_gaps_between_device_events_by_size_and_by_the_kernels_around_them(sp):
    def k(name, ts, dur, cat="kernel"):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur}
    events = [k("gemm", 0.0, 100.0), k("cast", 50.0, 60.0),   # overlapping: no gap inside the union
              k("norm", 115.0, 10.0),                            # 5 us after the union's end at 110
              k("adamw", 175.0, 10.0),                           # 50 us
              k("memcpy", 485.0, 5.0, cat="gpu_memcpy"),         # 300 us; a copy is device work too
              k("host_op", 490.0, 900.0, cat="cpu_op"),          # host events are not device time
              k("gemm", 491.0, 1.0)]                             # 1 us: under the 2 us threshold
    gaps = sp.idle_gaps(events, active=2)
    assert gaps["by_size_ms_per_step"] == pytest.approx({"under_10us": 0.0025, "10_100us": 0.025,
                                                          "over_100us": 0.15})
    assert gaps["idle_ms_per_step"] == pytest.approx(0.1775)
    assert [r["between"] for r in gaps["largest"]] == ["adamw -> memcpy", "norm -> adamw", "cast -> norm"]  # the last to end
    assert gaps["largest"][0]["count"] == 0.5
    assert sp.idle_gaps([k("x", 0, 0)], active=1) == {}


def test_the_unprofiled_timer_reports_each_step_beside_the_median(sp):
    class Event:  # a CUDA event's two methods the summary uses, at a given time in ms
        def __init__(self, t):
            self.t = t

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    timer = sp._UnprofiledTimer(first=3, last=6)
    timer.starts = [Event(t) for t in (0.0, 1800.0, 1900.0, 1988.0, 2076.0)]
    timer.optimizer_events = [(Event(10.0), Event(22.5)), (Event(100.0), Event(112.0))]
    out = timer.summary()
    assert out["each_step_ms"] == [1800.0, 100.0, 88.0, 88.0]
    assert out["step_ms"] == 94.0 and out["steps"] == 4  # the median of four: one slow step lifts it
    assert out["each_optimizer_ms"] == [12.5, 12.0] and out["optimizer_ms"] == 12.25


def test_the_unprofiled_window_starts_after_the_compiling_steps_and_ends_inside_the_profilers_wait(sp, monkeypatch):
    """fp8_delayed compiles in its steps 1-3 (no amax history, history, CUDA graphs' recording): a window that held
    step 3 reported ~1 s steps. The timer records a start event for each step first..last+1 (each step timed to the
    next start); the last must be a wait step of the profiler, whose warm-up starts at call PROFILER_WAIT + 1."""
    import torch

    first, last = sp.UNPROFILED_STEPS
    assert first >= 4 and last - first + 1 >= 5
    assert last + 1 <= sp.PROFILER_WAIT
    clock = {"n": 0, "ms": 0.0}

    class Event:  # a CUDA event recorded at the start of step n; steps take 88 ms but the last of the window 140
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t, self.step = clock["ms"], clock["n"]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = sp._UnprofiledTimer(*sp.UNPROFILED_STEPS)
    for n in range(1, sp.PROFILER_WAIT + 5):  # the worker's should_stop, called at every step's start
        clock["n"] = n
        timer.step_starts(n)
        clock["ms"] += 1200.0 if n <= 3 else (140.0 if n == last else 88.0)
    assert [e.step for e in timer.starts] == list(range(first, last + 2))
    out = timer.summary()
    assert out["each_step_ms"] == [88.0] * (last - first) + [140.0]
    assert out["step_ms"] == 88.0  # the median of five is not lifted by one slow step


def test_idle_without_profiler_splits_the_span_into_the_profilers_share_and_what_is_left(sp):
    # fp8_tensorwise at 509e541 (NOTES_floor 71): span 101.69, busy 96.09, unprofiled step 96.18 ms
    profile = {"gpu_span_ms_per_step": 101.69, "gpu_busy_ms_per_step": 96.09, "unprofiled": {"step_ms": 96.18}}
    split = sp.idle_without_profiler(profile)
    assert split["profiler_ms"] == pytest.approx(5.51) and split["left_ms"] == pytest.approx(0.09)
    # an unprofiled step longer than the span: nothing is the profiler's, all of its idle is left
    split = sp.idle_without_profiler({**profile, "unprofiled": {"step_ms": 103.0}})
    assert split["profiler_ms"] == 0.0 and split["left_ms"] == pytest.approx(6.91)
    assert sp.idle_without_profiler({"gpu_span_ms_per_step": 1.0, "gpu_busy_ms_per_step": 1.0}) == {}
    assert sp.idle_without_profiler({**profile, "unprofiled": None}) == {}
