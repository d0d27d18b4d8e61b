"""The step's memory-bound kernels on a GPU, each checked for bit-exactness against the path it replaces and
timed against it in the same run, with its floor at the bandwidth measured in the same run.

  * optimizer: MasterAdamW over the 1b model's parameters, bucket by bucket as the overlapped step issues it
    (not overlapped here), `update="compiled"` (inductor, one kernel per parameter) vs `"triton"` (one
    launch per bucket, training/optim_kernels.py); GPU and host ms per step; floor 28 B/param. Checked: the
    Triton update against the eager one (bit-exact) and the compiled one (mismatching elements counted).
  * mxfp8: both layouts of each 1b operand (X, dY, W), the compiled torch quantizers (what the emulation
    ran before) vs the fused kernel (training/precision/mxfp8_triton.py); floor 6 B/element. Checked
    bit-exact against the eager torch quantizer.
  * nvfp4: the fused quantizers' time per operand against their floor (8 B/element for X and dY).
  * fp8_delayed: the cast of each operand into both FP8 layouts with its amax, compiled torch ops (amax, cast,
    transposing copy: what the layer ran before) vs the fused cast-transpose (training/precision/
    fp8_triton.py); floor 4 B/element. Checked: codes bit-exact with the torch cast, and a real
    DelayedScalingLinear's forward and backward bit-identical with and without `fused_cast`.
Per-step figures multiply each shape by its occurrences in one 1b step (batch 4 x 2048). Prints a table last,
writes `$OUT/kernel_bench.json`.

    python bench/kernel_bench.py [--skip optimizer,mxfp8,nvfp4,fp8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchmeta import git_commit  # noqa: E402
from bench.step_profile import ADAMW_BYTES_PER_PARAM, device_ceilings, quant_bytes  # noqa: E402

HIDDEN, INTER, QKV, VOCAB, LAYERS, TOKENS = 2048, 8192, 4096, 32000, 16, 8192
# (rows, cols, occurrences per step) of the quantized operands of the 1b model, fused QKV, per layer x 16
X_SHAPES = [(TOKENS, HIDDEN, 4 * LAYERS), (TOKENS, INTER, LAYERS)]  # qkv, o, gate, up inputs; down input
DY_SHAPES = [(TOKENS, QKV, LAYERS), (TOKENS, HIDDEN, 2 * LAYERS), (TOKENS, INTER, 2 * LAYERS)]
W_SHAPES = [(QKV, HIDDEN, LAYERS), (HIDDEN, HIDDEN, LAYERS), (INTER, HIDDEN, 2 * LAYERS), (HIDDEN, INTER, LAYERS)]
OPTIMIZER_UPDATES = ("compiled", "triton")


def timed(fn, reps: int = 20) -> float:
    """Median ms of `reps` runs, each between CUDA events, after 3 warm-up runs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_timed(fn, calls: int = 20, reps: int = 10) -> float:
    """GPU ms per call: `calls` calls captured in one CUDA graph (as in the compiled step, no host launch cost),
    the graph replayed `reps` times between CUDA events, the median replay divided by `calls`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def model_buckets(dev) -> list[list[torch.nn.Parameter]]:
    """The 1b model's parameters (BF16, fused QKV) in the overlapped step's buckets: embedding, each layer,
    final norm + LM head."""
    def p(*shape):
        return torch.nn.Parameter((torch.randn(shape, device=dev) * 0.02).bfloat16())
    buckets = [[p(VOCAB, HIDDEN)]]
    for _ in range(LAYERS):
        buckets.append([p(QKV, HIDDEN), p(HIDDEN, HIDDEN), p(INTER, HIDDEN), p(INTER, HIDDEN), p(HIDDEN, INTER),
                        p(HIDDEN), p(HIDDEN)])
    buckets.append([p(HIDDEN), p(VOCAB, HIDDEN)])
    return buckets


def _groups(params):
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def optimizer_check(dev) -> dict:
    """Triton vs eager (must be bit-exact) and vs compiled on odd-sized parameters, 3 steps with clipping."""
    from training.optim import MasterAdamW

    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(4096, 2048), (37,), (3, 2049), (5000,)]
    base = [torch.randn(s, device=dev, generator=g).bfloat16() for s in shapes]
    runs = {}
    for update in ("eager", "compiled", "triton"):
        params = [torch.nn.Parameter(t.clone()) for t in base]
        opt = MasterAdamW(_groups(params), lr=3e-2, betas=(0.9, 0.95), update=update)
        gg = torch.Generator(device=dev).manual_seed(1)
        for step in range(3):
            for q in params:
                q.grad = (torch.randn(q.shape, device=dev, generator=gg) * 10.0 ** step).bfloat16()
            opt.grad_scale = torch.tensor(1.7, device=dev) if step % 2 else None
            opt.step()
        runs[update] = (params, opt)
    out = {}
    for other in ("eager", "compiled"):
        (pt, ot), (po, oo) = runs["triton"], runs[other]
        mism = {k: sum(int((ot.state[a][k] != oo.state[b][k]).sum()) for a, b in zip(pt, po))
                for k in ("master", "exp_avg", "exp_avg_sq")}
        mism["param"] = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(pt, po))
        out[f"triton_vs_{other}_mismatches"] = mism
    out["elements"] = sum(t.numel() for t in base)
    return out


def optimizer_ab(dev, ceilings: dict) -> dict:
    from training.optim import MasterAdamW

    rows = {}
    for update in OPTIMIZER_UPDATES:
        buckets = model_buckets(dev)
        params = [q for b in buckets for q in b]
        for q in params:
            q.grad = (torch.randn_like(q, dtype=torch.float32) * 1e-3).bfloat16()
        opt = MasterAdamW(_groups(params), lr=1e-4, betas=(0.9, 0.95), update=update)
        opt.grad_scale = torch.tensor(1.3, device=dev)
        host = []

        def step():
            t0 = time.perf_counter()
            for b in buckets:
                opt.step_params(b)
            host.append(time.perf_counter() - t0)
        t_compile = time.perf_counter()
        step()
        torch.cuda.synchronize()
        t_compile = time.perf_counter() - t_compile
        ms = timed(step, reps=10)
        # The step's device time summed over its kernels (the update and the small scalar ones; the profiler):
        # the timed step above also counts the gaps while the GPU waits for the host to issue the next bucket.
        from bench.step_profile import _profile
        prof = _profile(step, warmup=1, active=3)
        kernel_ms = prof["total_ms"]
        n = sum(q.numel() for q in params)
        floor = ADAMW_BYTES_PER_PARAM * n / (ceilings["copy_gbps"] * 1e6)
        rows[update] = {"gpu_ms": ms, "host_ms": 1e3 * statistics.median(host[-10:]), "params": n,
                        "floor_ms": floor, "ratio": ms / floor, "first_step_s": t_compile,
                        "kernel_ms": kernel_ms, "kernel_ratio": kernel_ms / floor,
                        "kernel_ms_by_category": prof["ms_per_step"]}
        print(f"[optimizer] {update}: {rows[update]}", flush=True)
        del opt, params, buckets
        torch.cuda.empty_cache()
    return rows


def _operand(shape, dev, g):
    rows, cols = shape[:2]
    return (torch.randn(rows, cols, device=dev, generator=g)
            / torch.rand(rows, cols, device=dev, generator=g).clamp_min(0.02).sqrt()).bfloat16()


def per_shape(label: str, parts, measure, dev) -> dict:
    """`measure(x, arg)` (a dict with fused_ms, floor_ms and maybe torch_compiled_ms, mismatch counts) for a
    heavy-tailed BF16 operand of every shape of `parts` ((operand, shapes, arg), ...); rows and per-step sums
    (each shape times its occurrences in a step)."""
    g = torch.Generator(device=dev).manual_seed(0)
    rows, per_step = [], {}
    for kind, shapes, arg in parts:
        for shape in shapes:
            x = _operand(shape, dev, g)
            row = {"operand": kind, "shape": list(shape[:2]), "count": shape[2], **measure(x, arg)}
            row["ratio"] = row["fused_ms"] / row["floor_ms"]
            rows.append(row)
            for k in ("torch_compiled_ms", "fused_ms", "floor_ms"):
                if k in row:
                    per_step[k] = per_step.get(k, 0.0) + row[k] * shape[2]
            print(f"[{label}] {row}", flush=True)
    return {"rows": rows, "per_step": per_step}


def _mismatches(*pairs) -> int:
    return sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in pairs)


def mxfp8_ab(dev, ceilings: dict) -> dict:
    from training.precision.formats import quantize_mxfp8
    from training.precision.mxfp8_triton import mxfp8_dual_quantize

    def torch_path(x):
        return (quantize_mxfp8(x, dtype=torch.bfloat16).values,
                quantize_mxfp8(x, axis=0, dtype=torch.bfloat16).values)
    compiled = torch.compile(torch_path)

    def measure(x, _):
        (a, b), (ref_a, ref_b), (ca, cb) = mxfp8_dual_quantize(x, "rceil"), torch_path(x), compiled(x)
        return {"mismatch_vs_eager": _mismatches((a, ref_a), (b, ref_b)),
                "mismatch_vs_compiled": _mismatches((a, ca), (b, cb)),
                "torch_compiled_ms": timed(lambda: compiled(x)),
                "fused_ms": timed(lambda: mxfp8_dual_quantize(x, "rceil")),
                "floor_ms": quant_bytes("mxfp8")[0] * x.numel() / (ceilings["copy_gbps"] * 1e6)}
    return per_shape("mxfp8", (("X", X_SHAPES, None), ("dY", DY_SHAPES, None), ("W", W_SHAPES, None)), measure,
                     dev)


def nvfp4_floor(dev, ceilings: dict) -> dict:
    from training.precision import nvfp4_triton as nt
    from training.precision.formats import random_sign_vector, rht_matrix

    h = nt.rht_operand(rht_matrix(random_sign_vector(0)), dev)

    def measure(x, stochastic):
        return {"fused_ms": timed(lambda: nt.nvfp4_dual_quantize(x, h, rht=True, stochastic=stochastic)),
                "floor_ms": quant_bytes("nvfp4")[0] * x.numel() / (ceilings["copy_gbps"] * 1e6)}
    return per_shape("nvfp4", (("X", X_SHAPES, False), ("dY", DY_SHAPES, True)), measure, dev)


def fp8_ab(dev, ceilings: dict) -> dict:
    from training.precision.formats import fp8_cast
    from training.precision.fp8_triton import fp8_cast_transpose

    def torch_path(x, scale, dtype):
        amax = x.abs().amax().to(torch.float32)
        q = fp8_cast(x, scale, dtype)[0]
        return q, q.t().contiguous(), amax
    compiled = torch.compile(torch_path)

    def measure(x, dtype):
        scale = (448.0 if dtype == torch.float8_e4m3fn else 57344.0) / x.float().abs().amax() * 0.7
        q, qt, amax = fp8_cast_transpose(x, scale, dtype)
        ref = fp8_cast(x, scale, dtype)[0]
        return {"mismatch_vs_eager": _mismatches((q, ref), (qt, ref.t().contiguous()))
                + int(amax != x.float().abs().amax()),
                "torch_compiled_ms": timed(lambda: compiled(x, scale, dtype)),
                "fused_ms": timed(lambda: fp8_cast_transpose(x, scale, dtype)),
                "floor_ms": quant_bytes("fp8_delayed")[0] * x.numel() / (ceilings["copy_gbps"] * 1e6)}
    out = per_shape("fp8", (("X", X_SHAPES, torch.float8_e4m3fn), ("dY", DY_SHAPES, torch.float8_e5m2),
                            ("W", W_SHAPES, torch.float8_e4m3fn)), measure, dev)
    out["layer_check"] = fp8_delayed_layer_check(dev)
    return out


def fp8_delayed_layer_check(dev) -> dict:
    """A real DelayedScalingLinear (history ready) with and without fused_cast: same Y, dX, dW, amaxes."""
    from training.precision.fp8_delayed import DelayedScalingLinear

    torch.manual_seed(0)
    base = torch.nn.Linear(2048, 4096, bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(4, 2048, 2048, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(4, 2048, 4096, device=dev, dtype=torch.bfloat16)
    outs = []
    for fused in (False, True):
        lin = torch.nn.Linear(2048, 4096, bias=False, device=dev, dtype=torch.bfloat16)
        lin.weight.data.copy_(base.weight)
        layer = DelayedScalingLinear(lin, history_len=4, real=True, fused_cast=fused)
        for _ in range(2):  # the first step fills the history; the second runs from it
            lin.weight.grad = None
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.backward(dy)
            layer.update_scales()
        outs.append((y.detach(), xi.grad, lin.weight.grad, layer.amax_history.clone()))
    names = ("Y", "dX", "dW", "amax_history")
    return {n: int((a.view(-1).view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32)
                    != b.view(-1).view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32)).sum())
            for n, a, b in zip(names, *outs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: optimizer, mxfp8, nvfp4")
    a = ap.parse_args(argv)
    skip = set(filter(None, a.skip.split(",")))
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    ceilings = device_ceilings()
    print(f"[ceilings] {ceilings}", flush=True)
    out = {"bench": "kernel_bench", "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git_commit(),
           "ceilings": ceilings}
    # the parts that compile little first; the compiled optimizer's first step compiles for a while
    if "mxfp8" not in skip:
        out["mxfp8"] = mxfp8_ab(dev, ceilings)
    if "fp8" not in skip:
        out["fp8"] = fp8_ab(dev, ceilings)
    if "nvfp4" not in skip:
        out["nvfp4"] = nvfp4_floor(dev, ceilings)
    if "optimizer" not in skip:
        out["optimizer_check"] = optimizer_check(dev)
        print(f"[optimizer check] {out['optimizer_check']}", flush=True)
        out["optimizer"] = optimizer_ab(dev, ceilings)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kernel_bench.json").write_text(json.dumps(out, indent=1))
    print_summary(out)
    return 0


def print_summary(out: dict) -> None:
    c = out["ceilings"]
    print(f"\n# kernel_bench on {out['device']}: copy {c['copy_gbps']:.0f} GB/s, BF16 {c['bf16_tflops']:.0f} "
          f"TFLOP/s, FP8 {c['fp8_tflops'] or 0:.0f} TFLOP/s")
    if "optimizer" in out:
        print(f"optimizer check: {out['optimizer_check']}")
        for update, r in out["optimizer"].items():
            print(f"optimizer {update:9s} GPU {r['gpu_ms']:7.2f} ms  host {r['host_ms']:6.2f} ms  floor "
                  f"{r['floor_ms']:6.2f} ms  ratio {r['ratio']:5.2f}x  kernels alone {r.get('kernel_ms', 0):7.2f} ms "
                  f"({r.get('kernel_ratio', 0):4.2f}x)")
    for part in ("mxfp8", "nvfp4", "fp8"):
        if part in out:
            s = out[part]["per_step"]
            mism = sum(r.get("mismatch_vs_eager", 0) for r in out[part]["rows"])
            base = f"compiled torch {s['torch_compiled_ms']:7.2f} ms  " if "torch_compiled_ms" in s else ""
            print(f"{part} quantizers per step: {base}fused {s['fused_ms']:7.2f} ms  floor {s['floor_ms']:6.2f} ms  "
                  f"ratio {s['fused_ms'] / s['floor_ms']:5.2f}x" + (f"  bit mismatches vs eager: {mism}"
                                                                      if part != "nvfp4" else ""))
    if "fp8" in out:
        print(f"fp8_delayed layer, fused_cast vs torch casts, mismatching elements: {out['fp8']['layer_check']}")
    print(f"wall {out['wall_s']} s")


if __name__ == "__main__":
    raise SystemExit(main())
