"""Where a training step's GPU time goes: the reference stack vs our trainer, kernel time by category.

Profiles 3 steps (after warm-up) of
  * `anchor`: the step of ../shared/tools/hf_llama_anchor.py (HF Llama in BF16, torch.compile, fused AdamW,
    labels=x), rebuilt here line for line so it can run under the profiler;
  * `ours:<config>`: training.train.train on the same shape, with the perf/param switches of the config
    (same syntax as bench/train_bench.py, e.g. `bf16`, `bf16:param_dtype=fp32`),
each in its own subprocess, and prints per category (GEMM, attention, optimizer, quantizers, other
elementwise or reduction kernels, copies/casts, communication) the GPU milliseconds per step, so that a gap
between two stacks can be attributed. The profiled window synchronizes the device at its edges, so it holds its
steps' kernels and no others (without that, the previous step's queued backward ran inside it: section 42 of
bench/NOTES_floor.md); its GPU work per step then matches the unprofiled step timed in the same run (nvfp4 135.3
against 135.4 ms). Launches per step of the top kernels and the fused quantizers' launch grids say which operands ran.

For each of our configs it also prints the **floor table**: per category the FLOPs it must do or the bytes it
must move for this model, batch and recipe (`step_floors`), the floor time at this device's ceilings measured
in the same call (`device_ceilings`: a large device-to-device copy counting bytes read and written; large BF16
and FP8 matrix products), and measured / floor. Kernels on the overlapped optimizer stream run concurrently
with the forward, so their profiled durations include the contention (the optimizer's ratio is an upper bound).

    python bench/step_profile.py anchor bf16 bf16:param_dtype=fp32
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CATEGORIES = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*(mha|attn)|_efficient_attention", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|sm90_xmma|nvjet|cublas|wgmma|matmul|_scaled_mm|splitk", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|lerp|addcmul", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    # our fused quantizers by name; inductor's quantizer kernels by their ops (the saturating clamp, abs-max)
    ("quantizers", re.compile(r"nvfp4|mxfp8|fp8|float8|quant|clamp|abs_amax|abs_max", re.I)),
    ("copy/cast", re.compile(r"memcpy|memset|copy_|to_copy|cast|direct_copy|fill", re.I)),
    ("triton/elementwise", re.compile(r"triton|elementwise|reduce|vectorized|unrolled|softmax|cross_entropy|nll|"
                                      r"log_softmax|embedding|index|scatter|gather", re.I)),
]


_COMPUTE_OPS = re.compile(r"_(add|mul|div|pow|sum|mean|rsqrt|exp|log|silu|sub|neg|sigmoid|tanh|amax|max|min)(?=_)")


def fused_cast_in_gemm(name: str, category: str) -> bool:
    """A kernel the "gemm" category holds only by name: an inductor pointwise or reduction kernel (`triton_poi_`,
    `triton_red_`, `triton_per_`) named after a `_scaled_mm` it feeds - the casts (and whatever producer they were
    fused into) of an FP8 GEMM, not the GEMM itself (inductor's GEMM templates are `triton_tem_`)."""
    return category == "gemm" and re.match(r"triton_(poi|red|per)_", name) is not None


# Our kernels that compute an elementwise op and, in the same pass, the maxima the next quantization needs (NVFP4's
# fused SwiGLU writes BF16 h, not a quantized operand): elementwise work, whose bytes the elementwise floor counts.
ELEMENTWISE_WITH_MAXIMA = re.compile(r"^_nvfp4_swiglu")


def categorize(name: str) -> str:
    if ELEMENTWISE_WITH_MAXIMA.search(name):
        return "triton/elementwise"
    for cat, rx in CATEGORIES:
        if rx.search(name):
            # inductor names a fused kernel after its ops: an RMSNorm is `triton_per_fused__to_copy_..._rsqrt`,
            # elementwise work that happens to upcast, not a copy
            if cat == "copy/cast" and name.startswith("triton_") and _COMPUTE_OPS.search(name):
                return "triton/elementwise"
            return cat
    return "other"


# ---------------------------------------------------------------------------------------------------- floors
# Bytes per element a recipe's quantizers must move for a GEMM operand (X and dY, W): the catalog's
# `quantizer_bytes` (training.precision.catalog says how they are counted).
def quant_bytes(recipe: str):
    """(activation/gradient operand, weight) bytes per element, or None for a recipe without quantizers."""
    from training.precision import catalog
    return catalog.get(recipe).quantizer_bytes


ADAMW_BYTES_PER_PARAM = 28  # MasterAdamW: BF16 grad read, BF16 param written, FP32 master, m, v read and written
OPTIMIZER_BYTES_PER_PARAM = ADAMW_BYTES_PER_PARAM + 2  # + the gradient norm's read of the BF16 gradients
COPY_BYTES = 1 << 30  # the bandwidth probe copies 1 GiB (read and written: 2 GiB moved)


def elementwise_bytes_per_token(dims: dict) -> int:
    """An estimate of what the step's elementwise kernels must move per token with BF16 activations, each
    tensor read and written once per pass: per layer two RMSNorms (forward 4H, backward 6H bytes), two
    residual adds (6H each way), SwiGLU (forward 6I, backward 10I) and RoPE on q and k (4 bytes per element
    each way); then the final norm, the embedding (gather and scatter) and the loss (the BF16 logits read
    once, their gradient written once)."""
    h, i = dims["hidden_size"], dims["intermediate_size"]
    qk = (dims["num_attention_heads"] + dims["num_key_value_heads"]) * dims["head_dim"]
    per_layer = 2 * (4 + 6) * h + 2 * (6 + 6) * h + 16 * i + 8 * qk
    return dims["num_hidden_layers"] * per_layer + 10 * h + 4 * h + 4 * dims["vocab_size"]


def step_floors(config, recipe: str, *, micro_batch: int, seq_len: int, params: int, ceilings: dict,
                grad_accum: int = 1, real_gemms: bool = False, bf16_layers: int = 0) -> dict:
    """Per category, what one optimizer step must do: {"work", "unit" ("FLOP" or "B"), "floor_ms", "basis"}.

    `config`: the LlamaConfig (or dims dict) of the run; `params`: its trainable parameter count; `ceilings`:
    `device_ceilings()` (copy_gbps, bf16_tflops, fp8_tflops). `real_gemms`: the converted linears run on FP8
    tensor cores (else BF16, as emulated formats do); `bf16_layers`: transformer blocks kept in BF16.
    copy/cast has no floor (a layout change or cast can always fuse into its producer or consumer)."""
    from training.gemm.shapes import gemm_shapes, model_dims

    dims = model_dims(config)
    tokens = micro_batch * seq_len * grad_accum
    layers = dims["num_hidden_layers"]
    converted = 0 if recipe == "bf16" else (layers - bf16_layers) / layers
    bw = ceilings["copy_gbps"] * 1e9
    lin_fp8 = lin_bf16 = 0.0
    for shape in gemm_shapes(dims, micro_batch, seq_len):
        flops = shape.flops * shape.count * grad_accum
        share = 0.0 if shape.layer == "lm_head" else converted
        lin_fp8 += flops * share if real_gemms else 0.0
        lin_bf16 += flops * (1.0 - share) if real_gemms else flops
    peak_bf16, peak_fp8 = ceilings["bf16_tflops"] * 1e12, (ceilings.get("fp8_tflops") or 0) * 1e12
    gemm_ms = 1e3 * (lin_bf16 / peak_bf16 + (lin_fp8 / peak_fp8 if lin_fp8 else 0.0))
    # causal attention without recomputation: QK^T and PV forward (each 2 s^2 H, half kept by the mask),
    # twice that backward: 6 s^2 H per layer and sequence, H = heads x head_dim
    attn = 6 * seq_len * seq_len * dims["num_attention_heads"] * dims["head_dim"] * layers * (
        micro_batch * grad_accum)
    out = {
        "gemm": {"work": lin_bf16 + lin_fp8, "unit": "FLOP", "floor_ms": gemm_ms,
                 "basis": f"linear layers, {'FP8' if real_gemms and converted else 'BF16'} peak"
                          + (" (LM head BF16)" if real_gemms and converted else "")},
        "attention": {"work": attn, "unit": "FLOP", "floor_ms": 1e3 * attn / peak_bf16,
                      "basis": "causal QK^T and PV, fwd + bwd, BF16 peak"},
        "optimizer": {"work": OPTIMIZER_BYTES_PER_PARAM * params, "unit": "B",
                      "floor_ms": 1e3 * OPTIMIZER_BYTES_PER_PARAM * params / bw,
                      "basis": "28 B/param update + 2 B/param gradient norm"},
        "triton/elementwise": {"work": elementwise_bytes_per_token(dims) * tokens, "unit": "B",
                               "floor_ms": 1e3 * elementwise_bytes_per_token(dims) * tokens / bw,
                               "basis": "estimate: norms, residual adds, SwiGLU, RoPE, loss"},
        "copy/cast": {"work": 0, "unit": "B", "floor_ms": 0.0, "basis": "none needed"},
    }
    if quant_bytes(recipe) and converted:
        act_b, w_b = quant_bytes(recipe)
        elems_act = elems_w = 0.0
        for shape in gemm_shapes(dims, micro_batch, seq_len):
            if shape.layer == "lm_head" or shape.gemm != "fprop":
                continue
            # fprop (m, k, n) = (tokens, in, out): X is m x k, dY is m x n, W is n x k (once per step)
            elems_act += (shape.m * shape.k + shape.m * shape.n) * shape.count * grad_accum * converted
            elems_w += shape.n * shape.k * shape.count * converted
        work = act_b * elems_act + w_b * elems_w
        out["quantizers"] = {"work": work, "unit": "B", "floor_ms": 1e3 * work / bw,
                             "basis": f"X, dY {act_b} B/elem, W {w_b} B/elem"}
    return out


def floor_rows(floors: dict, measured_ms: dict, unprofiled: dict | None = None) -> list[dict]:
    """Rows of the floor table: every category with a floor or a measurement, then the total; then, where the
    config's steps were also timed without the profiler (`_UnprofiledTimer`), the optimizer phase and the whole
    step from CUDA events, against the same floors."""
    rows = []
    for cat in list(floors) + [c for c in measured_ms if c not in floors]:
        f = floors.get(cat, {})
        ms = measured_ms.get(cat)
        floor = f.get("floor_ms")
        rows.append({"category": cat, "work": f.get("work"), "unit": f.get("unit"), "floor_ms": floor,
                     "measured_ms": ms, "ratio": (ms / floor) if ms is not None and floor else None,
                     "basis": f.get("basis", "no floor")})
    total_floor = sum(f["floor_ms"] for f in floors.values())
    total_ms = sum(measured_ms.values())
    rows.append({"category": "total", "work": None, "unit": None, "floor_ms": total_floor,
                 "measured_ms": total_ms, "ratio": total_ms / total_floor if total_floor else None,
                 "basis": "sum"})
    opt = floors.get("optimizer", {})
    extra = (("optimizer, unprofiled", opt.get("work"), opt.get("unit"), opt.get("floor_ms"),
              (unprofiled or {}).get("optimizer_ms"),
              "CUDA events: gradient norm to the end of the update (run after the backward), no profiler"),
             ("step, unprofiled", None, None, total_floor, (unprofiled or {}).get("step_ms"),
              "CUDA events: one whole step, no profiler"))
    for cat, work, unit, floor, ms, basis in extra:
        if ms is not None:
            rows.append({"category": cat, "work": work, "unit": unit, "floor_ms": floor, "measured_ms": ms,
                         "ratio": ms / floor if floor else None, "basis": basis})
    return rows


def format_floor_table(target: str, rows: list[dict]) -> str:
    def work(r):
        if r["work"] is None:
            return "-"
        return f"{r['work'] / 1e12:.1f} TFLOP" if r["unit"] == "FLOP" else f"{r['work'] / 1e9:.1f} GB"
    lines = [f"\n# floor table: {target} (ms per step; floor at this device's measured ceilings)",
             f"{'category':22s}{'work':>14s}{'floor':>9s}{'measured':>10s}{'ratio':>8s}  basis"]
    for r in rows:
        floor = f"{r['floor_ms']:9.2f}" if r["floor_ms"] is not None else f"{'-':>9s}"
        ms = f"{r['measured_ms']:10.2f}" if r["measured_ms"] is not None else f"{'-':>10s}"
        ratio = f"{r['ratio']:7.2f}x" if r["ratio"] is not None else f"{'-':>8s}"
        lines.append(f"{r['category']:22s}{work(r):>14s}{floor}{ms}{ratio}  {r['basis']}")
    return "\n".join(lines)


def device_ceilings() -> dict:
    """This GPU's copy bandwidth (bytes read + written per second) and BF16 / FP8 matrix-product rates,
    medians of timed runs on random data (not zeros), in the calling process."""
    import torch
    from triton.testing import do_bench

    src = torch.randn(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf16_ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    out = {"copy_gbps": 2 * COPY_BYTES / copy_ms / 1e6, "bf16_tflops": 2 * n ** 3 / bf16_ms / 1e9,
           "fp8_tflops": None, "device": torch.cuda.get_device_name()}
    if torch.cuda.get_device_capability() >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # _scaled_mm: B column-major
        one = torch.ones((), device="cuda")
        fp8_ms = do_bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                   use_fast_accum=True),
                          warmup=25, rep=200, return_mode="median")
        out["fp8_tflops"] = 2 * n ** 3 / fp8_ms / 1e9
    return out


def _profile(step_fn, warmup: int, active: int = 3) -> dict:
    import torch
    for _ in range(warmup):
        step_fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(active):
            step_fn()
        torch.cuda.synchronize()
    return summarize(prof, active)


def summarize(prof, active: int) -> dict:
    """Device time per category and the top kernels, per step, from a finished profiler."""
    by_cat: dict[str, float] = {}
    fused_casts = 0.0
    top = []
    calls: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if us <= 0 or evt.key.startswith("ProfilerStep"):
            continue
        # Only kernels and memcpy/memset (device events), not the CPU ops that launched them.
        if getattr(evt, "device_type", None) is not None and str(evt.device_type).endswith("CPU"):
            continue
        cat = categorize(evt.key)
        by_cat[cat] = by_cat.get(cat, 0.0) + us / 1e3 / active
        fused_casts += us / 1e3 / active if fused_cast_in_gemm(evt.key, cat) else 0.0
        top.append((us / 1e3 / active, evt.key[:110], cat))
        calls[evt.key[:110]] = evt.count / active
    top.sort(reverse=True)
    return {"ms_per_step": by_cat, "total_ms": sum(by_cat.values()), "top": top[:25],
            "top_calls_per_step": {name: calls[name] for _, name, _ in top[:25]},
            "gemm_fused_casts_ms": fused_casts, **gpu_busy(prof, active)}


FUSED_QUANTIZER = re.compile(r"^_(nvfp4|mxfp8|fp8)_\w*kernel")


def launch_grids(trace_events: list, active: int, pattern=FUSED_QUANTIZER) -> dict:
    """Per kernel whose name matches `pattern` (our fused quantizers), per launch grid: launches and GPU ms per step,
    from the profiler's Chrome-trace kernel events ("args": {"grid": [x, y, z]}). A quantizer's grid gives the
    operand it ran on (rows / 16 / groups x features / block), so a step's launches can be checked against the
    operands its layers have."""
    out: dict = {}
    for e in trace_events:
        if e.get("cat") != "kernel" or not pattern.search(e.get("name", "")):
            continue
        grid = "x".join(str(g) for g in (e.get("args") or {}).get("grid", []))
        row = out.setdefault(e["name"], {}).setdefault(grid, {"launches": 0.0, "ms": 0.0})
        row["launches"] += 1 / active
        row["ms"] += e.get("dur", 0.0) / 1e3 / active
    return out


GPU_EVENT_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def idle_gaps(trace_events: list, active: int, min_us: float = 2.0, top: int = 12) -> dict:
    """Where the GPU sits idle inside the profiled steps, from the Chrome trace's device events: the gaps between
    the union of kernel/copy intervals, per step, by size (under 10 us: launch latency; 10-100 us: a host-side
    op or a graph boundary; over 100 us: the host behind or a synchronisation), and the largest by the kernels on
    either side of them (ms and count per step), which names the boundary that waits. The profiler slows the host,
    so gaps the host leaves may be its own: `idle_without_profiler` says how much."""
    evs = sorted((e["ts"], e["ts"] + e.get("dur", 0.0), e.get("name", "")) for e in trace_events
                 if e.get("cat") in GPU_EVENT_CATS and e.get("dur", 0.0) > 0)
    if not evs:
        return {}
    buckets = {"under_10us": 0.0, "10_100us": 0.0, "over_100us": 0.0}
    pairs: dict = {}
    cur_end, cur_name = evs[0][1], evs[0][2]
    for s, e, name in evs[1:]:
        gap = s - cur_end
        if gap >= min_us:
            bucket = "under_10us" if gap < 10 else "10_100us" if gap < 100 else "over_100us"
            buckets[bucket] += gap / 1e3 / active
            row = pairs.setdefault(f"{cur_name[:70]} -> {name[:70]}", {"ms": 0.0, "count": 0.0})
            row["ms"] += gap / 1e3 / active
            row["count"] += 1 / active
        if e > cur_end:
            cur_end, cur_name = e, name
    largest = sorted(pairs.items(), key=lambda kv: -kv[1]["ms"])[:top]
    return {"idle_ms_per_step": sum(buckets.values()), "by_size_ms_per_step": buckets,
            "largest": [{"between": k, **v} for k, v in largest]}


def idle_without_profiler(profile: dict) -> dict:
    """How much of the profiled idle GPU time is the profiler's own: the profiled steps' GPU span against the
    unprofiled step timed with CUDA events in the same run. `profiler_ms` = span - unprofiled step (the host's
    cost under the profiler, which no change to the step removes); `left_ms` = unprofiled step - busy GPU (what
    idles without it, the part a faster host or CUDA graphs could take off). {} when either number is missing.
    (bench/NOTES_floor.md 71: fp8_tensorwise's 4.1 ms of idle gaps were 5.5 ms of profiler span; CUDA graphs gained
    0.4 ms.)"""
    span, busy = profile.get("gpu_span_ms_per_step"), profile.get("gpu_busy_ms_per_step")
    step = (profile.get("unprofiled") or {}).get("step_ms")
    if span is None or busy is None or step is None:
        return {}
    return {"profiler_ms": max(0.0, span - step), "left_ms": max(0.0, step - busy)}


def gpu_busy(prof, active: int) -> dict:
    """How much of the profiled steps' span the GPU was running at least one kernel or copy: the union of the
    device events' intervals against first start to last end. A share well below 1 means the host (launches,
    Python, synchronisations) leaves the GPU idle; near 1 the step is GPU-bound and only faster kernels help."""
    spans = []
    for evt in prof.events():
        if not str(getattr(evt, "device_type", "")).endswith("CUDA") or evt.key.startswith("ProfilerStep"):
            continue
        tr = evt.time_range
        if tr.end > tr.start:
            spans.append((tr.start, tr.end))
    if not spans:
        return {}
    spans.sort()
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e in spans) - spans[0][0]
    return {"gpu_busy_ms_per_step": busy / 1e3 / active, "gpu_span_ms_per_step": span / 1e3 / active,
            "gpu_busy_share": busy / span if span else None}


def anchor_worker(batch: int, seq: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_fn = torch.compile(model)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")

    def step():
        step_fn(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _profile(step, warmup=4)


# Our worker's steps: the profiler waits PROFILER_WAIT steps, then warms up for one and traces 3. The unprofiled timer
# covers steps UNPROFILED_STEPS (first..last, each timed to the next one's start) inside the wait: after the
# compiling steps (fp8_delayed compiles in steps 1-3: without the amax history, with it, then records its CUDA
# graphs; its step 3 took 0.9-1.4 s in the window of steps 3-6 used until 2026-11-27) and ending a step before the
# profiler's warm-up. Five steps, so that the median is not lifted by one slow step (the last of that old window
# ran 98-137 ms against 84-88 ms for fp8_delayed and 125 against 108-112 ms for bf16, cause not traced).
PROFILER_WAIT = 9
UNPROFILED_STEPS = (4, 8)


class _UnprofiledTimer:
    """CUDA events over steps `first`..`last` of our train(), while the profiler waits (its schedule's wait
    steps trace nothing): each step's GPU time (start to next start) and, where the update runs after the
    backward (no overlapped stepper), its optimizer phase: from the gradient norm (training.train._clip) to the
    end of MasterAdamW.step. Profiled kernel durations run longer than unprofiled ones (on an H100 at a7a2efe the
    bf16 step's profiled GPU work was 138.3 ms against a 114.2 ms unprofiled step), so the floor table sets these
    unprofiled times beside the profiled categories."""

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.n = 0
        self.starts: list = []
        self.optimizer_events: list = []
        self._pending = None
        self._saved = None

    def __enter__(self):
        import torch

        import training.train as tt
        from training.optim import MasterAdamW
        clip, step = tt._clip, MasterAdamW.step
        timer = self

        def timed_clip(run, clip_value):
            if run.stepper is None and run.on_cuda and timer.first <= timer.n <= timer.last:
                timer._pending = torch.cuda.Event(enable_timing=True)
                timer._pending.record()
            return clip(run, clip_value)

        def timed_step(opt, *args, **kwargs):
            out = step(opt, *args, **kwargs)
            if timer._pending is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                timer.optimizer_events.append((timer._pending, end))  # read at the end: no sync in the step
                timer._pending = None
            return out
        self._saved = (tt, clip, MasterAdamW, step)
        tt._clip, MasterAdamW.step = timed_clip, timed_step
        return self

    def __exit__(self, *exc):
        tt, clip, cls, step = self._saved
        tt._clip, cls.step = clip, step
        return False

    def step_starts(self, n: int) -> None:
        """Called at the start of step n (should_stop): the previous step's end."""
        import torch
        self.n = n
        if self.first <= n <= self.last + 1 and torch.cuda.is_available():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.starts.append(e)

    def summary(self) -> dict | None:
        import statistics
        if len(self.starts) < 2:
            return None
        self.starts[-1].synchronize()
        steps = [a.elapsed_time(b) for a, b in zip(self.starts, self.starts[1:])]
        optimizer = [a.elapsed_time(b) for a, b in self.optimizer_events]
        # Each step's time too: fp8_delayed's median here (96 ms at c376144) sat 8 ms above train_bench's timed
        # steps of the same code (88 ms), and a median of four cannot say which steps were slow.
        return {"steps": len(steps), "step_ms": statistics.median(steps),
                "optimizer_ms": statistics.median(optimizer) if optimizer else None,
                "each_step_ms": [round(s, 3) for s in steps], "each_optimizer_ms": [round(s, 3) for s in optimizer]}


def ours_worker(config_text: str, batch: int, seq: int) -> dict:
    """Our train() with a sink that opens the profiler after the warm-up steps' metrics arrive."""
    import torch
    from bench.train_bench import apply_diagnostics, parse_config, run_spec
    from training.sink import MetricSink
    from training.train import train

    config = parse_config(config_text)
    apply_diagnostics(config.get("diagnostic", {}))  # bench.inductor=..., as train_bench's workers do
    warmup, active = PROFILER_WAIT, 3
    spec = run_spec(config, steps=warmup + active + 4, batch=batch, seq=seq)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                  schedule=torch.profiler.schedule(wait=warmup, warmup=1, active=active, repeat=1))

    class StepSink(MetricSink):
        def log(self, step, metrics, *, tokens, wall_time):
            pass

        def event(self, kind, **fields):
            pass

    calls = {"n": 0}
    window = {}
    unprofiled = _UnprofiledTimer(*UNPROFILED_STEPS)
    # SM clock and power over the profiled steps (train_bench's NVML sampler): on an H100 at its 700 W cap the clock
    # the power controller picks differs by recipe and by minute, and bandwidth-bound kernels (the update) run
    # slower at a lower clock; a category's ratio is read against the clock it ran at.
    from bench.train_bench import GpuSampler, profiler_stepper
    sampler = GpuSampler()
    profiler_step = profiler_stepper(prof, warmup, active, torch.cuda.synchronize)

    def should_stop():  # called at the start of every step: the profiler's step boundary
        calls["n"] += 1
        unprofiled.step_starts(calls["n"])
        # synchronized at the window's edges: without it the window held 3 forwards and ~3.75 backwards of
        # kernels for its 3 steps (the previous step's queued backward), found from the launch counts per step
        profiler_step()
        if calls["n"] == warmup + 2:  # wait + warm-up done: the first active step starts
            window["from"] = time.perf_counter()
        elif calls["n"] == warmup + 2 + active:
            window["to"] = time.perf_counter()
        return False
    prof.start()
    with unprofiled:
        result = train(spec, StepSink(), should_stop=should_stop)
    prof.stop()
    sampler.stop()
    out_unprofiled = unprofiled.summary()
    out = summarize(prof, active)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as f:
            events = json.load(f).get("traceEvents", [])
        out["quantizer_launch_grids"] = launch_grids(events, active)
        out["idle_gaps"] = idle_gaps(events, active)
    out["unprofiled"] = out_unprofiled
    out["idle_without_profiler"] = idle_without_profiler(out)
    out["gpu_during_profiled_steps"] = (sampler.summary(window["from"], window["to"])
                                        if {"from", "to"} <= set(window) else None)
    out["run"] = {"recipe": config["recipe"], "params": result.summary.get("params"),
                  "gemm_backend": result.gemm_backend, "batch": batch, "seq_len": seq,
                  "grad_accum": spec["training"].get("grad_accum", 1), "model": spec["model"],
                  "vocab_size": spec["data"]["vocab_size"],
                  "overlap_optimizer": result.summary.get("overlap_optimizer"),
                  "compile_mode": result.summary.get("compile_mode"),
                  "cublaslt_workspace": result.summary.get("cublaslt_workspace")}
    return out


def fusion_probe(tokens: int, hidden: int = 2048, inter: int = 8192, q: int = 2048, kv: int = 512) -> dict:
    """ms per fwd+bwd (one layer's worth) of the projections as separate linears vs fused, BF16, compiled."""
    import torch
    from triton.testing import do_bench

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def make(outs):
        return [torch.nn.Linear(hidden, o, bias=False, device="cuda", dtype=torch.bfloat16) for o in outs]

    def bench(mods, combine):
        def f():
            ys = [m(x) for m in mods]
            combine(ys).backward()
        f = torch.compile(f)
        return do_bench(f, warmup=10, rep=60, return_mode="median")

    def qkv_loss(ys):
        return sum(y.float().square().mean() for y in ys) if len(ys) > 1 else sum(
            t.float().square().mean() for t in ys[0].split([q, kv, kv], dim=-1))

    def mlp_loss(ys):
        g, u = (ys[0], ys[1]) if len(ys) > 1 else ys[0].chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u).float().square().mean()
    out = {}
    out["qkv_separate_ms"] = bench(make([q, kv, kv]), qkv_loss)
    out["qkv_fused_ms"] = bench(make([q + 2 * kv]), qkv_loss)
    out["gate_up_separate_ms"] = bench(make([inter, inter]), mlp_loss)
    out["gate_up_fused_ms"] = bench(make([2 * inter]), mlp_loss)
    return out


def _run_targets(targets: list[str], a, results: dict, save=lambda: None) -> dict:
    """Each target profiled in its own subprocess, into `results`: {target: the worker's summary, or an
    error}; `save()` after each (a call cut short keeps what it measured)."""
    for target in targets:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", target, "--batch", str(a.batch),
                                   "--seq", str(a.seq)], capture_output=True, text=True, timeout=a.timeout_s,
                                  cwd=REPO)
            line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
            results[target] = json.loads(line) if line else {"error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            results[target] = {"error": f"timed out after {a.timeout_s} s"}
        results[target]["wall_s"] = time.perf_counter() - t0
        print(f"[profile] {target}: {time.perf_counter() - t0:.0f} s", flush=True)
        save()
    return results


def add_floor_tables(profiles: dict, ceilings: dict | None) -> None:
    """Each of our profiled configs gets `floor_table` rows (step_floors at the measured ceilings)."""
    from training.model import llama_config

    for r in profiles.values():
        run = r.get("run")
        if not run or not ceilings:
            continue
        config = llama_config(run["model"], run["vocab_size"], run["seq_len"])
        floors = step_floors(config, run["recipe"], micro_batch=run["batch"] // run["grad_accum"],
                             seq_len=run["seq_len"], grad_accum=run["grad_accum"], params=run["params"],
                             ceilings=ceilings, real_gemms=run["gemm_backend"] == "real")
        r["floor_table"] = floor_rows(floors, r["ms_per_step"], r.get("unprofiled"))


def _print_tables(profiles: dict) -> None:
    for target, r in profiles.items():
        if "top" in r:
            print(f"\n## {target}: top kernels (ms/step)")
            calls = r.get("top_calls_per_step", {})
            for ms, name, cat in r["top"][:14]:
                print(f"{ms:8.2f}  {calls.get(name, float('nan')):6.1f}x  {cat:18s} {name}")
            for kernel, grids in r.get("quantizer_launch_grids", {}).items():
                print(f"  {kernel}: " + ", ".join(f"grid {g} {v['launches']:.1f}x {v['ms']:.2f} ms"
                                                 for g, v in sorted(grids.items(), key=lambda kv: -kv[1]["ms"])))
    cats = sorted({c for r in profiles.values() for c in r.get("ms_per_step", {})})
    print("\n# GPU ms per step by category (profiled)")
    print(f"{'category':20s}" + "".join(f"{t[:22]:>24s}" for t in profiles))
    for c in cats + ["total"]:
        row = [r.get("total_ms") if c == "total" else r.get("ms_per_step", {}).get(c) for r in profiles.values()]
        print(f"{c:20s}" + "".join(f"{x:24.2f}" if x is not None else f"{'-':>24s}" for x in row))
    for target, r in profiles.items():
        if r.get("gpu_busy_share") is not None:
            print(f"{target}: GPU busy {r['gpu_busy_ms_per_step']:.1f} of {r['gpu_span_ms_per_step']:.1f} ms per step "
                  f"({100 * r['gpu_busy_share']:.1f} %)" + (
                      f"; SM {g['sm_clock_mhz_median']:.0f} MHz (min {g['sm_clock_mhz_min']:.0f}), "
                      f"{g['power_w_median']:.0f} W" if (g := r.get("gpu_during_profiled_steps")) else ""))
    for target, r in profiles.items():
        if gaps := r.get("idle_gaps"):
            sizes = ", ".join(f"{k} {v:.2f}" for k, v in gaps["by_size_ms_per_step"].items())
            print(f"{target}: GPU idle {gaps['idle_ms_per_step']:.2f} ms per step ({sizes})")
            if split := r.get("idle_without_profiler"):
                print(f"  of the span, {split['profiler_ms']:.2f} ms per step are the profiler's (span against the "
                      f"unprofiled step); without it the GPU idles {split['left_ms']:.2f} ms per step")
            for row in gaps["largest"][:8]:
                print(f"  {row['ms']:6.3f} ms {row['count']:5.1f}x  {row['between']}")
    for target, r in profiles.items():
        if r.get("gemm_fused_casts_ms"):
            print(f"{target}: of its gemm ms, {r['gemm_fused_casts_ms']:.1f} are inductor kernels named after a fused "
                  f"_scaled_mm (casts with their producers, not GEMMs)")
    for target, r in profiles.items():
        if "floor_table" in r:
            print(format_floor_table(target, r["floor_table"]))
    for target, r in profiles.items():
        if "error" in r:
            print(f"{target}: {r['error'][-600:]}")


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="*", help="`anchor` and/or train_bench-style configs of ours")
    ap.add_argument("--fusion-probe", action="store_true",
                    help="also time fwd+bwd of q,k,v / gate,up as separate linears vs one fused linear")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        out = anchor_worker(a.batch, a.seq) if a.worker == "anchor" else ours_worker(a.worker, a.batch, a.seq)
        print(json.dumps(out), flush=True)
        return 0
    import datetime as dt

    import torch
    from bench.benchmeta import git_commit

    results = {"bench": "step_profile", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "git_commit": git_commit(), "batch": a.batch, "seq": a.seq, "ceilings": None}
    if torch.cuda.is_available():
        results["ceilings"] = device_ceilings()
        torch.cuda.empty_cache()
        print(f"[ceilings] {results['ceilings']}", flush=True)
    if a.fusion_probe:
        results["fusion_probe"] = fusion_probe(a.batch * a.seq)
        for k, v in results["fusion_probe"].items():
            print(f"[fusion] {k}: {v}", flush=True)
    def save():
        add_floor_tables(profiles, results["ceilings"])  # after each target: a call cut short keeps its tables
        if os.environ.get("OUT"):
            (Path(os.environ["OUT"]) / "step_profile.json").write_text(json.dumps(results, indent=1))
    profiles = results["profiles"] = {}
    _run_targets(a.targets, a, profiles, save)
    save()
    _print_tables(profiles)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
