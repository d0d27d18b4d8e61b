"""Trainer throughput on one GPU against the reference stack, in one call.

What it runs, each in a fresh subprocess (so compile caches, allocator state and CUDA contexts never
leak from one measurement into the next):
  1. the reference `hf_llama_anchor.py --size 1b --recipe bf16` (HF Llama, BF16 params, compile, fused AdamW);
  2. our `training.train.train` on the `1b` preset, batch 4 x 2048, random tokens, compile on, once per
     config: a recipe name, optionally with perf switches, e.g. `bf16:sdpa_backend=cudnn,fused_loss=false`.
Metrics go every step through a sink that batches points in a background thread and serialises them
like an HTTP client would (JSON batches), and the time the training thread spends in `sink.log` is
reported as a share of the step time.

Usage (on the GPU machine, repo root; the anchor is looked up at .devcarry/hf_llama_anchor.py, then
../shared/tools/hf_llama_anchor.py):

    python bench/train_bench.py                                  # anchor + every recipe, until the budget
    python bench/train_bench.py --configs bf16 bf16:sdpa_backend=cudnn bf16:fused_loss=false
    python bench/train_bench.py --configs bf16 fp8_tensorwise --budget-s 500 --no-anchor
    python bench/train_bench.py --configs bf16 --gpus 2 --batch 8 --no-anchor   # 2-GPU DDP, global batch 8
    # 2-GPU scaling in one call, same global batch (8 x 2048) and per-GPU micro-batch (4) on both sides:
    python bench/train_bench.py --configs bf16:grad_accum=2 bf16:gpus=2 --batch 8 --no-anchor \
        --baseline bf16:grad_accum=2
    python bench/train_bench.py --configs bf16 --no-anchor --profile            # where the step's time goes
    python bench/train_bench.py --configs bf16 fp8_tensorwise --rounds 5 --steps 20   # A/B interleaved in rounds
        (with 2+ rounds each config timed in the baseline's group is also compared with it round by round:
        the mean difference, the rounds it was faster in, a sign-flip test; `vs_baseline_by_round` in the JSON)

Perf switches (training.perf of the run spec): fused_loss, loss_chunk_tokens, fused_clip, bf16_residual,
sdpa_backend (auto|cudnn|flash|efficient|math), compile_mode, metrics_lag, prefetch, allow_tf32; plus
`compile` and `activation_checkpointing` (training keys). An A/B of the BF16 path in one call (~8 min):

    python bench/train_bench.py --configs bf16 bf16:sdpa_backend=cudnn \
        bf16:sdpa_backend=cudnn,bf16_residual=true bf16:fused_loss=false,fused_clip=false

FSDP2 and larger shapes (presets 3b, 8b; training keys parallel, activation_checkpointing none|full|blocks|ops,
activation_checkpointing_every, init_device cpu|device), e.g. the 8B shape on 2 GPUs, one config at a time:

    python bench/train_bench.py --model 8b --seq 8192 --batch 2 --gpus 2 --no-anchor --concurrency 1 \
        --configs bf16:parallel=fsdp,activation_checkpointing=full,init_device=device \
                  fp8_tensorwise:parallel=fsdp,activation_checkpointing=full,init_device=device

Perf switches added since: cublaslt_workspace (default|none), loss_weight_grad (auto|one_gemm|per_chunk), rope_backward (auto|one_pass|compiled), fuse_qkv, fuse_gate_up, overlap_optimizer
(true|false; null = auto), compile_scope, ddp_bucket_mb, ddp_static_graph, gc_interval, fsdp_prefetch, fsdp_fused_cast, fsdp_one_rank_direct
(docs/INTERFACES.md); per config also gpus, grad_accum, batch; and the training key param_dtype (bf16|fp32|auto).

Writes `$OUT/train_bench.json` (when $OUT is set) and, on a GPU, `bench/results/train_bench_<date>_<gpu>.json`,
and prints the ratio table last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchmeta import git_commit  # noqa: E402

ANCHOR_PATHS = [REPO / ".devcarry" / "hf_llama_anchor.py", REPO.parent / "shared" / "tools" / "hf_llama_anchor.py"]
BOOL_KEYS = {"fused_loss", "prefetch", "allow_tf32", "fused_clip", "bf16_residual", "compile",
             "fuse_qkv", "overlap_optimizer", "ddp_static_graph",
             "fuse_gate_up", "sync_free_mask", "reuse_quantized_weights", "fsdp_prefetch",
             "fsdp_fused_cast", "fsdp_one_rank_direct"}
INT_KEYS = {"loss_chunk_tokens", "metrics_lag", "gpus", "grad_accum", "batch", "ddp_bucket_mb", "gc_interval",
            "activation_checkpointing_every"}
# Options whose value "none" is one of their choices (elsewhere "none"/"null" mean unset: None).
NONE_IS_A_CHOICE = {"cublaslt_workspace", "activation_checkpointing"}
TRAINING_KEYS = {"compile", "activation_checkpointing", "activation_checkpointing_every", "param_dtype", "gpus",
                 "grad_accum", "parallel", "init_device"}


# ---------------------------------------------------------------------------------------------------
# configs
def _recipe_option(value: str):
    """A recipe option's value from a config string: true/false, an integer, or the text itself."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return int(value) if value.isdigit() else value


def allocator_stats() -> dict | None:
    """The CUDA caching allocator over the whole run: peak reserved memory, and how often it had to return cached
    memory to the driver and retry (`alloc_retries`: each frees cached blocks after synchronizing the device) or
    went to cudaMalloc / cudaFree at all. None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats()
    return {"reserved_peak_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
            "alloc_retries": stats.get("num_alloc_retries", 0), "device_allocs": stats.get("num_device_alloc", 0),
            "device_frees": stats.get("num_device_free", 0), "sync_all_streams": stats.get("num_sync_all_streams", 0)}


def parse_config(text: str) -> dict:
    """'bf16:sdpa_backend=cudnn,fused_loss=false' → {"label", "recipe", "perf": {...}, "training": {...},
    "recipe_options": {...}}; `recipe.NAME=value` sets a recipe option (e.g. `mxfp8:recipe.fused_quantize=false`)."""
    recipe, _, opts = text.partition(":")
    perf, training, batch, recipe_options, diagnostic = {}, {}, None, {}, {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"config {text!r}: expected key=value, got {item!r}")
        if key.startswith("bench."):
            if key not in DIAGNOSTICS or value not in DIAGNOSTICS[key]:
                raise SystemExit(f"config {text!r}: {key}={value!r}; diagnostics: {DIAGNOSTICS}")
            diagnostic[key[len("bench."):]] = value
            continue
        if key.startswith("recipe."):
            recipe_options[key[len("recipe."):]] = _recipe_option(value)
            continue
        if key in BOOL_KEYS:
            if value.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise SystemExit(f"config {text!r}: {key} takes true/false, got {value!r}")
            value = value.lower() in ("true", "1", "on")
        elif key in INT_KEYS:
            if not value.isdigit() or int(value) < 1 and key not in ("metrics_lag", "gc_interval"):
                raise SystemExit(f"config {text!r}: {key} takes a positive integer, got {value!r}")
            value = int(value)
        elif value in ("none", "null") and key not in NONE_IS_A_CHOICE:
            value = None
        if key == "batch":
            batch = value
            continue
        (training if key in TRAINING_KEYS else perf)[key] = value
    return {"label": text, "recipe": recipe, "perf": perf, "training": training, "recipe_options": recipe_options,
            **({"batch": batch} if batch is not None else {}), **({"diagnostic": diagnostic} if diagnostic else {})}


# Diagnostic switches of the bench itself (not of training): they break training on purpose to time what is left.
# `bench.update=skip`: MasterAdamW's Triton update does nothing (no scalar ops, no kernel): the step without it, so
# the A/B against the plain config is the update's share of the critical path. `bench.update=host_only`: the host
# work of the update (step counters, bias corrections, table) without the kernel launch.
# `bench.inductor=emulate_precision_casts`: inductor rounds every intermediate to its dtype as eager does (its
# default keeps fused BF16 intermediates in FP32), to tell a graph change's last-bit effects from a real difference.
# `bench.inductor=coordinate_descent`: inductor tunes each pointwise/reduction kernel's block sizes by timing them
# at compile time (its coordinate_descent_tuning, part of max-autotune, here without the GEMM autotuning).
# value -> (inductor config name, the value set)
INDUCTOR_SETTINGS = {"emulate_precision_casts": ("emulate_precision_casts", True),
                     "coordinate_descent": ("coordinate_descent_tuning", True),
                     # user Triton kernels (torch.library.triton_op) take their inputs in whatever layout inductor
                     # gives them instead of a copy in the traced strides (bench/NOTES_floor.md 59; nvfp4 runs so by
                     # its own Recipe.inductor_settings since 8b81ae6, section 84)
                     "flexible_user_kernels": ("triton_kernel_default_layout_constraint", "flexible_layout"),
                     # a pointwise result with several users is stored once (not recomputed per user) from 4 reads
                     # on instead of 5 (bench/NOTES_floor.md 59)
                     "realize_reads_3": ("realize_reads_threshold", 3),
                     # the RMSNorm backward's weight gradients: inductor's mix-order reduction kernel writes one FP32
                     # partial row per `split` tokens (16 at the 1b shape on 132 SMs: 512 rows) and the wrapper sums
                     # them with torch's column reduction, 2 a layer (bench/NOTES_floor.md 75)
                     "mix_split_32": ("triton.mix_order_reduction_split_size", 32),
                     "mix_split_64": ("triton.mix_order_reduction_split_size", 64),
                     "mix_split_autotune": ("triton.mix_order_reduction_autotune_split_size", True),
                     "no_mix_order": ("triton.mix_order_reduction", False)}
DIAGNOSTICS = {"bench.update": ("skip", "host_only"), "bench.inductor": tuple(INDUCTOR_SETTINGS)}


def apply_diagnostics(diagnostic: dict) -> None:
    """In the worker, before training: the monkeypatches of `DIAGNOSTICS` (the parameters then never change)."""
    if diagnostic.get("inductor") in INDUCTOR_SETTINGS:
        import torch._inductor.config as inductor_config

        name, value = INDUCTOR_SETTINGS[diagnostic["inductor"]]
        *path, leaf = name.split(".")
        setattr(functools.reduce(getattr, path, inductor_config), leaf, value)
    mode = diagnostic.get("update")
    if mode is None:
        return
    from training import optim_kernels

    if mode == "skip":
        optim_kernels.adamw_master_update = lambda *args, **kwargs: None
    else:
        class _NoLaunch:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: None
        optim_kernels._adamw_master_kernel = _NoLaunch()


# Default order: the recipes with a speed bar first; fp8_blockwise last, since torchao's blockwise
# Triton GEMMs autotune at their first call (~3 minutes of compile on an H100), which must not crowd out the others.
RUN_FIRST = ("bf16", "fp8_tensorwise", "fp8_delayed", "mxfp8", "nvfp4", "fp8_rowwise")


def default_configs(recipes: list[str]) -> list[str]:
    return sorted(recipes, key=lambda r: RUN_FIRST.index(r) if r in RUN_FIRST else len(RUN_FIRST))


def _model_label(model: str, results: list[dict]) -> str:
    """The header's model: the preset and its parameter count as the runs reported it (e.g. "1b (1.14B)")."""
    params = next((r.get("params") or (r.get("summary") or {}).get("params") for r in results
                   if r.get("params") or (r.get("summary") or {}).get("params")), None)
    return f"{model} ({params / 1e9:.2f}B)" if params else model


def model_value(model: str):
    """The spec's `model` for --model: a preset name as is, or `PRESET:key=value,...` as that preset's dims with
    some changed (e.g. `8b:num_hidden_layers=40`, Llama-3-8B's blocks 40 deep), which the spec validates."""
    from training.config import CUSTOM_MODEL_KEYS, MODEL_PRESETS

    preset, colon, opts = model.partition(":")
    if not colon:
        return model
    if preset not in MODEL_PRESETS:
        raise SystemExit(f"--model {model!r}: unknown preset {preset!r}; use one of {list(MODEL_PRESETS)}")
    dims = dict(MODEL_PRESETS[preset])
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in CUSTOM_MODEL_KEYS or not value.isdigit():
            raise SystemExit(f"--model {model!r}: expected key=positive integer with key one of "
                             f"{list(CUSTOM_MODEL_KEYS)}, got {item!r}")
        dims[key] = int(value)
    return dims


def run_spec(config: dict, *, steps: int, batch: int, seq: int, model: str = "1b", device: str = "cuda",
             gpus: int = 1) -> dict:
    training = {"steps": steps, "batch_size": batch, "gpus": gpus, "lr": 1e-4, "warmup_steps": 1, "val_every": 0,
                "val_batches": 0, "checkpoint_every": 0, "compile": True, "device": device,
                "perf": dict(config["perf"])}
    training.update(config["training"])
    return {"model": model_value(model), "data": {"corpus": "random", "vocab_size": 32000, "seq_len": seq},
            "training": training, "seed": 0, "recipe": config["recipe"],
            "recipe_options": dict(config.get("recipe_options", {}))}


# ---------------------------------------------------------------------------------------------------
# worker side: one config in this process
from training.flops import mfu  # noqa: E402 (needs the repo root on sys.path)
from training.sink import MetricSink  # noqa: E402 (needs the repo root on sys.path)


class ApiStub:
    """A stand-in for the Precision Lab API's metric endpoint in a separate process (the GPU machine has no
    database): parses each POSTed JSON batch like the real endpoint and answers as it does
    ({"inserted", "duplicates", "cancel_requested"}). What is measured is the client side: the real
    workers.client.MetricStreamer behind workers.jobs.train.ApiSink, as a training job uses it."""

    def __init__(self):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_api_stub_main, args=(child,), daemon=True)
        self.proc.start()
        self.url = parent.recv()

    def close(self):
        self.proc.terminate()


def _api_stub_main(conn):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, body: dict):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            n = len(body.get("points", [])) if isinstance(body, dict) else 0
            self._reply({"inserted": n, "duplicates": 0, "cancel_requested": False})

        def do_GET(self):
            self._reply({"id": 1, "status": "running", "cancel_requested": False})

        def do_PATCH(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._reply({"id": 1})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    conn.send(f"http://127.0.0.1:{server.server_address[1]}")
    server.serve_forever()


def profiler_stepper(prof, wait: int, active: int, sync=None):
    """`prof.step` for the sink's per-step callback, with `sync()` (the device's synchronize) at the active window's
    edges: the (wait + 1)-th call opens it and the (wait + 1 + active)-th closes it. The host runs ahead of the
    GPU, so without the sync the window also counted work queued before it (bench/NOTES_floor.md 42, found with
    step_profile's launch counts)."""
    calls = [0]

    def step():
        calls[0] += 1
        if sync is not None and calls[0] in (wait + 1, wait + 1 + active):
            sync()
        prof.step()
    return step


class TimedApiSink(MetricSink):
    """The workers' ApiSink (real HTTP client, batching thread) plus a local copy of the points; records
    the time the training thread spends in `log`."""

    def __init__(self, api_url: str | None):
        from training.sink import ListSink
        self.inner = ListSink()
        self.log_seconds: list[float] = []
        self.log_at: dict[int, float] = {}  # step -> perf_counter when its metrics were logged
        self.api = None
        if api_url:
            from workers.client import MetricStreamer, PlabClient
            from workers.jobs.train import ApiSink
            client = PlabClient(api_url)
            self.api = ApiSink(client, 1, MetricStreamer(client, 1))

    on_step = None  # called once per logged training step (drives the profiler's schedule)

    def log(self, step, metrics, *, tokens, wall_time):
        if self.on_step is not None and "train/loss" in metrics:
            self.on_step()
        t0 = time.perf_counter()
        self.log_at.setdefault(step, t0)
        if self.api is not None:
            self.api.log(step, metrics, tokens=tokens, wall_time=wall_time)
        self.log_seconds.append(time.perf_counter() - t0)
        self.inner.log(step, metrics, tokens=tokens, wall_time=wall_time)

    def event(self, kind, **fields):
        self.inner.event(kind, **fields)

    def flush(self):
        if self.api is not None:
            self.api.flush()

    def close(self):
        if self.api is not None:
            self.api.streamer.close()
            self.api.client.close()


class GpuSampler:
    """SM clock, power, temperature and utilisation of this process's GPU every 100 ms (NVML, on a thread),
    so a slow config can be told apart from a throttled GPU. Inactive without NVML or a GPU."""

    def __init__(self, interval_s: float = 0.1):
        self.samples: list[tuple[float, int, float, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml
            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            index = int(os.environ.get("LOCAL_RANK", "0"))
            if visible and visible.split(",")[index].strip().isdigit():
                index = int(visible.split(",")[index])
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001 - no NVML (CPU runs): sample nothing
            return
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float):
        nv, h = self._nvml, self._handle
        # Why the clock is below its maximum (NVML's clocks event / throttle reasons bitmask: 0x4 software power
        # cap, 0x20 software thermal, 0x40 hardware thermal, 0x8 hardware slowdown); -1 where NVML lacks it.
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        while not self._stop.wait(interval_s):
            try:
                self.samples.append((time.perf_counter(), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                     nv.nvmlDeviceGetPowerUsage(h) / 1000.0, nv.nvmlDeviceGetTemperature(h, 0),
                                     nv.nvmlDeviceGetUtilizationRates(h).gpu, reasons(h) if reasons else -1))
            except Exception:  # noqa: BLE001
                return

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def window(self, t_from: float, t_to: float) -> list[tuple]:
        return [s for s in self.samples if t_from <= s[0] <= t_to]

    def trace(self, t_from: float, t_to: float) -> list[list[float]]:
        """[seconds after t_from, SM clock MHz, power W, clock reasons bitmask] of every sample in [t_from, t_to]:
        what a step's time can be set against (a clock drop at the power limit, say)."""
        return [[round(s[0] - t_from, 3), s[1], round(s[2], 1), s[5]] for s in self.window(t_from, t_to)]

    def summary(self, t_from: float, t_to: float) -> dict | None:
        window = self.window(t_from, t_to)
        if not window:
            return None
        clocks, power = [s[1] for s in window], [s[2] for s in window]
        return {"samples": len(window), "sm_clock_mhz_median": statistics.median(clocks),
                "sm_clock_mhz_min": min(clocks), "power_w_median": statistics.median(power),
                "temp_c_max": max(s[3] for s in window),
                "util_pct_median": statistics.median(s[4] for s in window)}


class Gate:
    """Holds a worker at the start of each step in `at` (round k at at[k]) until the driver lets it time the
    next round of steps, so that no other config's compile, warm-up or timed steps run on the GPU while this
    one is timed (see the driver)."""

    def __init__(self, gate_dir: str | None, name: str, at: list[int]):
        self.dir = Path(gate_dir) if gate_dir else None
        self.name, self.rounds, self.calls = name, {step: k for k, step in enumerate(at)}, 0

    def __call__(self) -> bool:
        self.calls += 1
        k = self.rounds.get(self.calls)
        if self.dir is not None and k is not None:
            import torch
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # nothing of this worker left queued on the GPU while it waits
            (self.dir / f"{self.name}.ready{k}").touch()
            while not (self.dir / f"{self.name}.go{k}").exists():
                time.sleep(0.05)
        return False


def paired_by_round(base_steps: list[float], steps: list[float], rounds: int, *, exact_max: int = 16,
                    samples: int = 1 << 16) -> dict | None:
    """A config against the baseline timed in the same group, paired by round: each round's mean step of the config
    minus the baseline's (ms; the two ran back to back in that round, A B then B A, so the power cap's and the
    clock's drift between rounds cancels in the difference), how many rounds the config was faster in, and a
    sign-flip permutation test of the mean difference (two-sided; exact over the 2^rounds sign patterns up to
    `exact_max` rounds, else `samples` random ones with a fixed seed). None where the steps do not split into
    `rounds` equal rounds (a config stopped early) or there is only one round."""
    import itertools
    import random

    if rounds < 2 or not steps or len(steps) != len(base_steps) or len(steps) % rounds:
        return None
    per = len(steps) // rounds
    diffs = [1e3 * (sum(steps[k * per:(k + 1) * per]) - sum(base_steps[k * per:(k + 1) * per])) / per
             for k in range(rounds)]
    observed = abs(sum(diffs)) - 1e-12
    if rounds <= exact_max:
        patterns = itertools.product((1, -1), repeat=rounds)
        total = 2 ** rounds
    else:
        rng = random.Random(0)
        patterns = ([rng.choice((1, -1)) for _ in range(rounds)] for _ in range(samples))
        total = samples
    extreme = sum(abs(sum(s * d for s, d in zip(signs, diffs))) >= observed for signs in patterns)
    return {"rounds": rounds, "steps_per_round": per, "diff_ms": [round(d, 3) for d in diffs],
            "mean_diff_ms": sum(diffs) / rounds, "faster_in": sum(d < 0 for d in diffs),
            "sign_flip_p": extreme / total, "exact": rounds <= exact_max}


def gate_steps(warmup: int, steps: int, rounds: int) -> tuple[list[int], int]:
    """The steps a worker waits at (one per round, untimed: the wait lands in its time) and its step count:
    `warmup` untimed steps, then per round a gate step and ceil(steps / rounds) timed ones."""
    chunk = -(-steps // rounds)
    gates = [warmup + 1 + k * (chunk + 1) for k in range(rounds)]
    return gates, warmup + rounds * (chunk + 1)


def worker(config_json: str, steps: int, warmup: int, batch: int, seq: int, out_dir: Path, model: str,
           device: str, gpus: int, profile: bool = False, api_url: str | None = None,
           gate_dir: str | None = None, rounds: int = 1) -> dict | None:
    import torch
    from training.train import train

    config = json.loads(config_json)
    apply_diagnostics(config.get("diagnostic", {}))
    # Steps: `warmup` untimed (compile, allocator), then per round a gate step (the worker may wait before
    # it for the driver's go, which lands in that step's time, so it is not timed) and the round's timed steps.
    gates, total_steps = gate_steps(warmup, steps, rounds)
    gate_step = gates[0]
    spec = run_spec(config, steps=total_steps, batch=batch, seq=seq, model=model, device=device, gpus=gpus)
    rank = int(os.environ.get("RANK", "0"))
    sink = TimedApiSink(api_url if rank == 0 else None)
    gate = Gate(gate_dir, config["slot"], gates) if gate_dir else None
    prof = None
    if profile:
        # Kernel-time table of 3 steps after warm-up; the profiled steps are slower, so a profiled
        # run's tokens/s is marked and must not be compared with unprofiled ones.
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = torch.profiler.profile(activities=acts, schedule=torch.profiler.schedule(
            wait=gate_step, warmup=1, active=3, repeat=1))
        prof.start()
        sink.on_step = profiler_stepper(prof, gate_step, 3,
                                        torch.cuda.synchronize if torch.cuda.is_available() else None)
    sampler = GpuSampler() if device != "cpu" else None
    t0 = time.perf_counter()
    try:
        result = train(spec, sink, should_stop=gate)
    finally:
        sink.close()
        if sampler is not None:
            sampler.stop()
        if prof is not None:
            prof.stop()
    if prof is not None and int(os.environ.get("RANK", "0")) == 0:
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        safe = "".join(ch if ch.isalnum() else "_" for ch in config["label"])[:60]
        averages = prof.key_averages()
        (out_dir / f"profile_{safe}.txt").write_text(
            averages.table(sort_by=sort, row_limit=40)
            + "\n\n# by own CPU time (host-side stalls: syncs, launches, Python ops)\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=30))
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 reports
        return None
    wall = time.perf_counter() - t0
    per_step = {p["step"]: p["metrics"] for p in sink.inner.points if "perf/step_time_s" in p["metrics"]}
    timed_steps = [s for s in sorted(per_step) if s > gate_step and s not in gates]
    timed = [per_step[s] for s in timed_steps]
    step_s = statistics.median(m["perf/step_time_s"] for m in timed)
    total_step_s = sum(m["perf/step_time_s"] for m in timed)
    tokens_per_step = batch * seq
    log_s = sink.log_seconds[gate_step:] or sink.log_seconds
    return {
        "label": config["label"], "recipe": config["recipe"], "status": result.status,
        "spec": spec, "steps_timed": len(timed), "rounds": rounds,
        "final_loss": result.final_loss,
        "losses": [round(per_step[s]["train/loss"], 5) for s in sorted(per_step) if "train/loss" in per_step[s]],
        "tokens_per_s": tokens_per_step / step_s, "step_time_s": step_s, "gpus": gpus,
        "tokens_per_s_per_gpu": tokens_per_step / step_s / gpus, "parallel": result.summary.get("parallel"),
        "activation_checkpointing": result.summary.get("activation_checkpointing"),
        "compile_mode": result.summary.get("compile_mode"),
        "cublaslt_workspace": result.summary.get("cublaslt_workspace"),
        "loss_weight_grad": result.summary.get("loss_weight_grad"),
        "rope_backward": result.summary.get("rope_backward"),
        "step_time_min_s": min(m["perf/step_time_s"] for m in timed),
        "step_time_max_s": max(m["perf/step_time_s"] for m in timed),
        "data_wait_share": sum(m["perf/data_wait_s"] for m in timed) / total_step_s,
        "sink_log_share": (sum(log_s) / len(log_s)) / step_s,
        "host_issue_share": statistics.median(m.get("perf/host_issue_s", 0.0) for m in timed) / step_s,
        # MFU from the same median step as tokens_per_s and tflops (the training summary's median spans every step
        # after the first two, gate and warm-up steps included: kept as mfu_run_summary).
        "mfu": mfu(result.summary["flops_per_token"], tokens_per_step / step_s, device_name=result.device_name,
                   n_gpus=gpus),
        "mfu_run_summary": result.summary.get("mfu"),
        "tflops": tokens_per_step / step_s * result.summary["flops_per_token"] / 1e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "allocator": allocator_stats(),
        "gemm_backend": result.gemm_backend,
        "label_kind": {"real": "real", "emulated": "emulated", "bf16": "real (bf16)"}.get(result.gemm_backend,
                                                                                         result.gemm_backend),
        "params": result.summary.get("params"), "flops_per_token": result.summary.get("flops_per_token"),
        "first_steps_s": [per_step[s]["perf/step_time_s"] for s in sorted(per_step)[:warmup]],
        "timed_steps_s": [round(m["perf/step_time_s"], 5) for m in timed],
        "param_dtype": result.summary.get("param_dtype"), "api_logging": api_url is not None,
        "api_points_sent": sink.api.streamer.sent if sink.api is not None else None,
        "wall_s": wall, "device_name": result.device_name, "profiled": profile,
        # GPU clock/power while the timed steps' metrics arrived (they are logged metrics_lag steps late).
        "gpu_during_timed_steps": (sampler.summary(sink.log_at.get(timed_steps[0], 0.0), sink.log_at.get(timed_steps[-1], 0.0))
                                   if sampler is not None and timed_steps else None),
        **_gpu_trace(sampler, sink, timed_steps),
    }


def _gpu_trace(sampler, sink, timed_steps: list[int]) -> dict:
    """The NVML samples from the first timed step's log time to the last one's, and each timed step's log time on
    the same clock (a step's metrics are logged metrics_lag steps after it ends)."""
    if sampler is None or not timed_steps or timed_steps[0] not in sink.log_at:
        return {}
    t0, t1 = sink.log_at[timed_steps[0]], sink.log_at.get(timed_steps[-1], 0.0)
    return {"gpu_trace": {"step_logged_s": [round(sink.log_at.get(s, t0) - t0, 3) for s in timed_steps],
                          "samples_s_mhz_w_reasons": sampler.trace(t0, t1)}}


# ---------------------------------------------------------------------------------------------------
# driver side
def _last_json_line(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _run(cmd: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-1500:]
        return {"error": f"timed out after {timeout:.0f} s",
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail,
                "wall_s": time.perf_counter() - t0}
    out = _last_json_line(proc.stdout)
    if proc.returncode != 0 or out is None:
        return {"error": f"exit code {proc.returncode}", "stderr_tail": proc.stderr[-3000:],
                "wall_s": time.perf_counter() - t0}
    out.setdefault("wall_s", time.perf_counter() - t0)
    return out


def _fmt(x, spec=".0f"):
    width = int("".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or 0)
    return f"{'-':>{width}}" if x is None else format(x, spec)


def _worker_cmd(config: dict, a, scratch: Path, api_url: str | None, gate_dir: Path | None) -> list[str]:
    gpus = config["training"].get("gpus", a.gpus)  # per-config overrides: `bf16:gpus=2`, `bf16:batch=8`
    batch = config.get("batch", a.batch)
    launcher = [sys.executable] if gpus == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    return [*launcher, str(Path(__file__).resolve()), "--worker", json.dumps(config),
            "--worker-out", str(scratch), "--steps", str(a.steps), "--warmup", str(a.warmup),
            "--batch", str(batch), "--seq", str(a.seq), "--model", a.model, "--device", a.device,
            "--gpus", str(gpus), "--rounds", str(a.rounds), *(["--profile"] if a.profile else []),
            *(["--api-url", api_url] if api_url else []), *(["--gate-dir", str(gate_dir)] if gate_dir else [])]


def _finish(proc: subprocess.Popen, config: dict, t0: float, timeout: float) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        ran = time.perf_counter() - t0
        # `timeout` is what was left of the group's deadline when the wait began, not how long the worker ran.
        return {"label": config["label"], "recipe": config["recipe"],
                "error": f"timed out: still building or running after {ran:.0f} s (the group's deadline: "
                         "--per-run-timeout-s per config, or the call's remaining --budget-s)",
                "stderr_tail": (stderr or "")[-1500:], "wall_s": ran}
    out = _last_json_line(stdout)
    if proc.returncode != 0 or out is None:
        return {"label": config["label"], "recipe": config["recipe"], "error": f"exit code {proc.returncode}",
                "stderr_tail": (stderr or "")[-3000:], "wall_s": time.perf_counter() - t0}
    out.setdefault("wall_s", time.perf_counter() - t0)
    return out


def memory_bound_reason(res: dict) -> str | None:
    """Why a config's timing from a shared group cannot stand: its allocator had to free cached memory (each retry
    synchronizes the device), or it ran out of memory, because the group's processes held their memory at once."""
    retries = (res.get("allocator") or {}).get("alloc_retries")
    if retries:
        return f"{retries} allocator retries while the group's processes shared the GPU's memory"
    if "error" in res and "out of memory" in (res.get("stderr_tail") or "").lower():
        return "out of memory while the group's processes shared the GPU's memory"
    return None


def run_configs(configs: list[dict], a, scratch: Path, remaining, api_url: str | None) -> list[dict]:
    """Run the configs `a.concurrency` at a time. Each group's workers build, compile and warm up at once
    (CPU-bound, the slow part), then wait at their gate; only when every worker of the group is waiting
    does the driver let them time their steps, one after the other. So while a config's timed steps run,
    no other process issues GPU work, and the compile time of a group is paid once. A config whose timing
    the shared memory spoiled (`memory_bound_reason`) is run again alone, budget permitting; its result
    keeps what happened in the group under `in_group`."""
    results: list[dict | None] = [None] * len(configs)  # by the configs' order, whatever order they run in
    durations: list[float] = []
    pending = [{**c, "_index": i} for i, c in enumerate(configs)]
    while pending:
        group = [pending.pop(0)]  # a config to be timed again alone ("_alone") is a group of its own
        while pending and len(group) < a.concurrency and not (group[0].get("_alone") or pending[0].get("_alone")):
            group.append(pending.pop(0))
        # The quickest group so far is the estimate (one slow compile, e.g. fp8_blockwise's autotuning, must not
        # make every later group look unaffordable); each group also has a hard deadline below.
        expected = min(durations) if durations else 60.0
        if remaining() < expected:
            for config in group + pending:
                skipped = f"budget: {remaining():.0f} s left, a group takes ~{expected:.0f} s"
                _place(results, config, {"label": config["label"], "recipe": config["recipe"], "skipped": skipped})
                print(f"[bench] skip {config['label']}: out of budget", flush=True)
            break
        t0 = time.perf_counter()
        group_results = _run_group(group, 1 + len(durations), a, scratch, api_url, remaining)
        durations.append(time.perf_counter() - t0)
        for config, res in zip(group, group_results):
            _place(results, config, res)
            reason = memory_bound_reason(res) if len(group) > 1 else None
            if reason:
                print(f"[bench] {config['label']}: {reason}: timing it again alone", flush=True)
                pending.insert(0, {**config, "_alone": reason})
    return [r for r in results if r is not None]


def _place(results: list, config: dict, res: dict) -> None:
    """Store `res` at the config's place. A config run again alone replaces its group result, which it keeps as
    `in_group`; if the budget did not allow the second run, the group result stays, saying so."""
    i = config["_index"]
    reason = config.get("_alone")
    if reason and "skipped" in res:
        results[i]["not_retimed_alone"] = f"{reason}; {res['skipped']}"
    elif reason:
        first = results[i]
        res["in_group"] = {k: first[k] for k in ("group", "step_time_s", "allocator", "error") if k in first}
        res["retimed_alone"] = reason
        results[i] = res
    else:
        results[i] = res


def _run_group(group: list[dict], group_no: int, a, scratch: Path, api_url: str | None, remaining) -> list[dict]:
    gate_dir = Path(tempfile.mkdtemp(prefix="plab-gate-"))
    t0 = time.perf_counter()
    procs = []
    for i, config in enumerate(group):
        config = {k: v for k, v in config.items() if k not in ("_alone", "_index")}
        config["slot"] = f"g{group_no}_{i}"
        cmd = _worker_cmd(config, a, scratch, api_url, gate_dir)
        procs.append((config, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                               text=True, cwd=REPO)))
    deadline = t0 + min(a.per_run_timeout_s * len(group), max(remaining(), 1))
    finished = time_group(procs, gate_dir, a.rounds, t0, deadline)
    group_results = []
    for config, _ in procs:
        res = finished[config["slot"]]
        res.setdefault("label", config["label"])
        res.setdefault("recipe", config["recipe"])
        res["group"] = group_no
        group_results.append(res)
        print(f"[bench] {config['label']}: {json.dumps({k: v for k, v in res.items() if k != 'spec'})[:600]}",
              flush=True)
    return group_results


def time_group(procs: list[tuple[dict, subprocess.Popen]], gate_dir: Path, rounds: int, t0: float,
               deadline: float) -> dict[str, dict]:
    """Let a group's workers time their steps one at a time, `rounds` times over (the order reversed every
    other round: A B, B A, ...), so slow drift - clocks, temperature - reaches every config of the group alike.
    Before each go every other live worker must be waiting at a gate; if one is not by the deadline, the
    worker goes anyway and its result says `timed_alone: false`."""
    def at_gate(config: dict, k: int) -> bool:
        return (gate_dir / f"{config['slot']}.ready{k}").exists()

    def wait(pred) -> bool:
        while time.perf_counter() < deadline:
            if pred():
                return True
            time.sleep(0.05)
        return pred()

    gone = [0] * len(procs)  # rounds let go, per worker
    alone = {c["slot"]: True for c, _ in procs}
    finished: dict[str, dict] = {}

    def quiet(i: int) -> bool:  # worker i issues no GPU work now: exited, or waiting at its next gate
        config, proc = procs[i]
        return proc.poll() is not None or config["slot"] in finished or at_gate(config, gone[i])

    for k in range(rounds):
        order = list(range(len(procs)))
        if k % 2:
            order.reverse()
        for i in order:
            config, proc = procs[i]
            if config["slot"] in finished:
                continue
            others_quiet = wait(lambda: all(quiet(j) for j in range(len(procs))))
            if proc.poll() is not None:  # it failed before this round: collect it
                finished[config["slot"]] = _finish(proc, config, t0, 1)
                continue
            alone[config["slot"]] &= others_quiet
            (gate_dir / f"{config['slot']}.go{k}").touch()
            gone[i] += 1
            if k == rounds - 1:
                finished[config["slot"]] = _finish(proc, config, t0, deadline - time.perf_counter())
            else:
                wait(lambda: at_gate(config, k + 1) or proc.poll() is not None)
    for config, proc in procs:  # a worker that never reached a gate in time
        if config["slot"] not in finished:
            finished[config["slot"]] = _finish(proc, config, t0, deadline - time.perf_counter())
    for config, _ in procs:
        finished[config["slot"]]["timed_alone"] = alone[config["slot"]]
    return finished


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", "--recipes", nargs="*", default=None,
                    help="recipe[:key=value,...] entries (default: every recipe of training.precision.RECIPES)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=6, help="untimed first steps (compile, allocator)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--budget-s", type=float, default=520.0, help="skip configs that cannot finish within this")
    ap.add_argument("--per-run-timeout-s", type=float, default=300.0)
    ap.add_argument("--no-anchor", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="write a kernel-time table per config to $OUT/profile_<config>.txt (slows those runs)")
    ap.add_argument("--gpus", type=int, default=1,
                    help="GPUs per config (torchrun + DDP); --batch stays the global batch")
    ap.add_argument("--baseline", default="bf16",
                    help="the config label the 'vs bf16' column divides by (e.g. bf16:grad_accum=2 for a scaling run)")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--model", default="1b",
                    help="model preset (1b is the anchor's shape), or PRESET:key=value,... for that preset with "
                         "some dims changed, e.g. 8b:num_hidden_layers=40")
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script")
    ap.add_argument("--concurrency", type=int, default=2,
                    help="configs built and compiled at once (each is then timed alone); one whose memory the group's "
                         "processes squeezed (allocator retries, out of memory) is run again on its own")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each group's configs in this many interleaved rounds (A B, B A, ...) of "
                         "ceil(steps / rounds) steps, so drift reaches every config alike")
    ap.add_argument("--blockwise-autotune", choices=["quick", "full"], default="quick",
                    help="fp8_blockwise: autotune torchao's quantizers over 8 of their 45 configs (quick, fits the "
                         "one-call budget) or all (full: ~3 min more compile); PLAB_BLOCKWISE_AUTOTUNE")
    ap.add_argument("--no-api", action="store_true", help="log metrics to a local list only, not through the "
                    "API client")
    ap.add_argument("--api-url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--gate-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.concurrency < 1:
        ap.error(f"--concurrency must be >= 1, got {a.concurrency}")
    if not 1 <= a.rounds <= a.steps:
        ap.error(f"--rounds must be between 1 and --steps ({a.steps}), got {a.rounds}")
    from training.config import ModelSpec, SpecError
    try:
        ModelSpec.from_value(model_value(a.model))
    except SpecError as e:
        ap.error(f"--model {a.model!r}: {e}")

    if a.worker is not None:
        res = worker(a.worker, a.steps, a.warmup, a.batch, a.seq, Path(a.worker_out), a.model, a.device, a.gpus,
                     a.profile, a.api_url, a.gate_dir, a.rounds)
        if res is not None:
            print(json.dumps(res), flush=True)
        return 0

    if not a.no_api:
        # Before the reference's minute on the device: every worker streams through the API client, so a machine
        # without its dependencies would run the reference and then fail every config.
        try:
            import workers.client  # noqa: F401
        except ImportError as e:
            ap.error(f"the workers' API client does not import here ({e}): install the project's dependencies "
                     f"(on a device machine, carry the wheel of the module named), or pass --no-api to log "
                     f"metrics to a local list only")
    t_begin = time.perf_counter()
    os.environ["PLAB_BLOCKWISE_AUTOTUNE"] = a.blockwise_autotune  # inherited by the config workers
    out_env = os.environ.get("OUT")
    # Per-config metric streams and profiles: next to the JSON under $OUT, else in a temp dir (they are
    # scratch, not results to commit).
    scratch = Path(out_env) if out_env else Path(tempfile.mkdtemp(prefix="plab-train-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    if a.configs is None:
        from training.precision import RECIPES
        a.configs = default_configs(list(RECIPES))
    configs = [parse_config(c) for c in a.configs]

    def remaining():
        return a.budget_s - (time.perf_counter() - t_begin)

    anchor = None
    if not a.no_anchor:
        path = next((p for p in ANCHOR_PATHS if p.exists()), None)
        if path is None:
            anchor = {"error": f"anchor script not found at {[str(p) for p in ANCHOR_PATHS]}"}
        else:
            anchor = _run([sys.executable, str(path), "--size", "1b", "--recipe", "bf16", "--batch", str(a.batch),
                           "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup)],
                          timeout=min(a.per_run_timeout_s, max(remaining(), 1)))
        print(f"[bench] anchor: {json.dumps(anchor)[:400]}", flush=True)

    api = ApiStub() if not a.no_api else None
    results = run_configs(configs, a, scratch, remaining, api.url if api else None)
    if api is not None:
        api.close()

    device = next((r.get("device_name") for r in results if r.get("device_name")), None)
    if device is None:
        try:
            import torch
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        except Exception:  # noqa: BLE001 - only for the report header
            device = "unknown"
    ours_bf16 = next((r for r in results if r.get("label") == a.baseline and "tokens_per_s" in r), None)
    anchor_tps = anchor.get("tokens_per_s") if anchor else None
    for r in results:
        if "tokens_per_s" in r:
            r["vs_anchor"] = r["tokens_per_s"] / anchor_tps if anchor_tps else None
            r["vs_our_bf16"] = r["tokens_per_s"] / ours_bf16["tokens_per_s"] if ours_bf16 else None
            timed_with_baseline = (ours_bf16 is not None and r is not ours_bf16 and "group" in r
                                   and r["group"] == ours_bf16.get("group")
                                   and not r.get("retimed_alone") and not ours_bf16.get("retimed_alone"))
            paired = timed_with_baseline and paired_by_round(ours_bf16["timed_steps_s"], r["timed_steps_s"], a.rounds)
            if paired:
                r["vs_baseline_by_round"] = {"baseline": a.baseline, **paired}
    report = {
        "bench": "train_bench", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device, "git_commit": git_commit(), "model": _model_label(a.model, results),
        "batch": a.batch, "seq": a.seq, "gpus": a.gpus, "baseline": a.baseline, "timed_steps": a.steps, "warmup_steps": a.warmup,
        "anchor": anchor, "results": results, "total_wall_s": time.perf_counter() - t_begin,
        "concurrency": a.concurrency, "rounds": a.rounds, "api_logging": not a.no_api,
        "blockwise_autotune": a.blockwise_autotune,
        "notes": "tokens/s from the median timed step (CUDA events); MFU against the dense BF16 peak for every "
                 "recipe; emulated recipes' throughput is not hardware throughput. Configs are built and compiled "
                 f"{a.concurrency} at a time, then each is timed alone (the others wait at a gate with nothing "
                 f"queued on the GPU; timed_alone says it held), in {a.rounds} interleaved round(s) per group. "
                 "Metrics of every step go through the real API client (workers.jobs.train.ApiSink, "
                 "MetricStreamer over HTTP) to a stub endpoint in another process; sink% is the training "
                 "thread's time in log() per step. fp8_blockwise autotuning: "
                 + ("torchao's quantizer kernels over 8 of their 45 launch configs (--blockwise-autotune quick)"
                    if a.blockwise_autotune == "quick" else "all configs") + ".",
    }
    text = json.dumps(report, indent=1, default=str)
    if out_env:
        (Path(out_env) / "train_bench.json").write_text(text)
    if a.device != "cpu":  # a CPU run only checks the script: no result to commit
        results_dir = REPO / "bench" / "results"
        results_dir.mkdir(parents=True, exist_ok=True)
        gpu_tag = "".join(ch if ch.isalnum() else "_" for ch in device)[:40]
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%M")
        tag = f"_{a.tag}" if a.tag else ""
        (results_dir / f"train_bench_{stamp}_{gpu_tag}{tag}.json").write_text(text)

    print(f"\n# train_bench on {a.gpus} x {device}, {a.model}, global batch {a.batch}x{a.seq}, "
          f"median of {a.steps} steps" + ("; a config's own batch= where its label sets one"
                                           if any("batch" in c for c in configs) else ""))
    if anchor_tps:
        print(f"anchor hf_llama_anchor bf16: {anchor_tps:,.0f} tok/s, step {anchor['step_s'] * 1e3:.1f} ms, "
              f"peak {anchor.get('peak_mem_gib', 0):.1f} GiB")
    elif anchor:
        print(f"anchor: {anchor.get('error')}")
    print(f"{'config':56s} {'tok/s':>9s} {'vs anchor':>9s} {'vs base':>8s} {'step ms':>8s} {'MFU':>6s} "
          f"{'GiB':>6s} {'wait%':>6s} {'sink%':>6s} {'host%':>6s}  gemm")
    for r in results:
        if "tokens_per_s" not in r:
            print(f"{r['label'][:56]:56s} {r.get('skipped') or r.get('error')}")
            continue
        print(f"{r['label'][:56]:56s} {r['tokens_per_s']:9,.0f} {_fmt(r['vs_anchor'], '9.3f')} "
              f"{_fmt(r['vs_our_bf16'], '8.3f')} {r['step_time_s'] * 1e3:8.1f} {_fmt(r['mfu'], '6.3f')} "
              f"{_fmt(r['peak_mem_gib'], '6.1f')} {100 * r['data_wait_share']:6.2f} {100 * r['sink_log_share']:6.3f} {100 * r.get('host_issue_share', 0):6.1f}  "
              f"{r['label_kind']}{'' if r.get('timed_alone', True) else '  NOT timed alone'}"
              + (f"  SM {g['sm_clock_mhz_median']:.0f} MHz (min {g['sm_clock_mhz_min']}), {g['power_w_median']:.0f} W"
                 if (g := r.get("gpu_during_timed_steps")) else "")
              + (f"  reserved {m['reserved_peak_gib']:.1f} GiB, {m['alloc_retries']} alloc retries, "
                 f"{m['device_frees']} cudaFree" if (m := r.get("allocator")) else "")
              + ("  MEMORY-BOUND TIMING: the allocator synchronized to free memory" if (m or {}).get("alloc_retries")
                 else "")
              + (f"  (timed again alone: {r['retimed_alone']})" if r.get("retimed_alone") else ""))
    paired = [r for r in results if r.get("vs_baseline_by_round")]
    if paired:
        print(f"\npaired by round against {a.baseline} (config minus baseline, ms per step, each round's mean; "
              "sign-flip test of the mean)")
        for r in paired:
            p = r["vs_baseline_by_round"]
            print(f"{r['label'][:56]:56s} {p['mean_diff_ms']:+8.2f} ms, faster in {p['faster_in']} of {p['rounds']} "
                  f"rounds, p = {p['sign_flip_p']:.3f}{'' if p['exact'] else ' (sampled)'}  "
                  f"[{', '.join(f'{d:+.2f}' for d in p['diff_ms'])}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
