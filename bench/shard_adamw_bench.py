"""torch's fused AdamW over FP32 shards vs training.optim_kernels' `adamw_shard_update` on a GPU: which of the
kernel's candidate arithmetic forms gives torch's bits, and the time of each over the 1b model's parameters.

FSDP2 keeps FP32 master shards; the overlapped sharded update (training.parallel.LocalFusedAdamW) called
`torch._fused_adamw_` with the clipping factor as `grad_scale`, which divides each gradient as it reads it and
stores it back. The Triton kernel makes the same update without the store (28 B per parameter instead of 32).

  1. Scalar forms (how the bias corrections reach the element loop): every combination over 3 steps (weight
     decay, a grad_scale on one step, step counters 1-3 and 1000-1002), elements differing from torch's kernel.
  2. Per-element FMA forms of m, v and the decay, each on its own, the others at their default: one step over
     `--elements` random elements, `--reps` times; a wrong contraction differs from torch's in ~1e-9 of the
     elements (an FP64 result one ulp apart straddling an FP32 rounding boundary), so this needs ~1e9 samples.
  3. Time: each over the 1b model's parameters (FP32, world size 1: the shards are the whole tensors), with a
     grad_scale, GPU ms (CUDA events) against the floor (32 B and 28 B per parameter at the copy bandwidth
     measured in the call).
Prints a table last, writes `$OUT/shard_adamw_bench_<date>_<device>_at_<commit>.json`.

    python bench/shard_adamw_bench.py [--elements 268435456 --reps 8]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchmeta import git_commit  # noqa: E402
from bench.kernel_bench import HIDDEN, INTER, LAYERS, QKV, VOCAB, timed  # noqa: E402
from bench.step_profile import device_ceilings  # noqa: E402
from training import optim_kernels as ok  # noqa: E402

HYPER = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8)


def _state(shapes, dev, gen, step0: float):
    ps = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in shapes]
    ms = [torch.randn(s, device=dev, generator=gen) * 1e-3 for s in shapes]
    vs = [torch.rand(s, device=dev, generator=gen) * 1e-6 for s in shapes]
    steps = [torch.tensor(step0, device=dev) for _ in shapes]
    return ps, ms, vs, steps


def _clone(ts):
    return [t.clone() for t in ts]


def _torch_step(ps, gs, ms, vs, steps, scale, wd):
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(ps, [g.clone() for g in gs], ms, vs, [], steps, amsgrad=False, lr=HYPER["lr"],
                        beta1=HYPER["beta1"], beta2=HYPER["beta2"], weight_decay=wd, eps=HYPER["eps"],
                        maximize=False, grad_scale=scale, found_inf=None)


def _ours_step(ps, gs, ms, vs, steps, scale, wd, forms, tables):
    torch._foreach_add_(steps, 1)
    ok.adamw_shard_update(ps, gs, ms, vs, steps, weight_decay=wd, grad_scale=scale, tables=tables, forms=forms,
                          **HYPER)


def _diff(a, b) -> int:
    return sum(int((x.view(torch.int32) != y.view(torch.int32)).sum()) for x, y in zip(a, b))


def scalar_forms(dev) -> list[dict]:
    shapes = [(4096, 2048), (37,), (3, 2049), (5000,)]
    rows = []
    for bias2, bias1, step0 in itertools.product(("f32_sqrt", "f32", "f64"), ("f32", "f64"), (0.0, 999.0)):
        gen = torch.Generator(device=dev).manual_seed(0)
        ref = _state(shapes, dev, gen, step0)
        ours = [_clone(t) for t in ref]
        tables = ok.AdamWTables()
        forms = {"bias2": bias2, "bias1": bias1}
        for k in range(3):
            gs = [torch.randn(s, device=dev, generator=gen) * 10.0 ** (k - 3) for s in shapes]
            scale = torch.tensor(1.7, device=dev) if k == 1 else None
            _torch_step(*ref[:1], gs, *ref[1:], scale, 0.1)
            _ours_step(*ours[:1], gs, *ours[1:], scale, 0.1, forms, tables)
        row = {"bias2": bias2, "bias1": bias1, "first_step": step0 + 1, "param": _diff(ref[0], ours[0]),
               "exp_avg": _diff(ref[1], ours[1]), "exp_avg_sq": _diff(ref[2], ours[2]),
               "elements": sum(p.numel() for p in ref[0])}
        print(f"[scalar forms] {row}", flush=True)
        rows.append(row)
    return rows


def element_forms(dev, elements: int, reps: int, base: dict) -> list[dict]:
    variants = [("m", f) for f in (0, 1, 2)] + [("v", f) for f in (0, 1, 2)] + [("decay_fma", f) for f in (False, True)]
    counts = {v: {"param": 0, "exp_avg": 0, "exp_avg_sq": 0} for v in variants}
    shapes = [(elements,)]
    for r in range(reps):
        gen = torch.Generator(device=dev).manual_seed(100 + r)
        ref = _state(shapes, dev, gen, 0.0)
        start = [_clone(t) for t in ref]
        gs = [torch.randn(elements, device=dev, generator=gen) * 1e-3]
        scale = torch.tensor(1.3, device=dev)
        _torch_step(*ref[:1], gs, *ref[1:], scale, 0.1)
        for key, form in variants:
            ours = [_clone(t) for t in start]
            _ours_step(*ours[:1], gs, *ours[1:], scale, 0.1, {**base, key: form}, ok.AdamWTables())
            c = counts[(key, form)]
            c["param"] += _diff(ref[0], ours[0])
            c["exp_avg"] += _diff(ref[1], ours[1])
            c["exp_avg_sq"] += _diff(ref[2], ours[2])
            del ours
        del ref, start, gs
        torch.cuda.empty_cache()
    rows = [{"form": key, "value": form, "samples": elements * reps, **counts[(key, form)]} for key, form in variants]
    for row in rows:
        print(f"[element forms] {row}", flush=True)
    return rows


def op_candidates(dev, elements: int = 1 << 24) -> dict:
    """One step without decay or scale: torch's kernel and ours against m and v written as torch ops in FP64
    (the C++ expression's types) and in FP32 (the betas rounded to FP32), elements differing."""
    gen = torch.Generator(device=dev).manual_seed(7)
    (p,), (m,), (v,), steps = _state([(elements,)], dev, gen, 0.0)
    g = torch.randn(elements, device=dev, generator=gen) * 1e-3
    b1, b2 = HYPER["beta1"], HYPER["beta2"]
    d = torch.float64
    cand_m = {"f64": (b1 * m.to(d) + (1 - b1) * g.to(d)).float(),
              "f32": m * torch.tensor(b1, device=dev) + g * torch.tensor(1 - b1, device=dev),
              "f32_lerp": torch.lerp(m, g, 1 - b1)}
    cand_v = {"f64": (b2 * v.to(d) + (1 - b2) * g.to(d) * g.to(d)).float(),
              "f32": v * torch.tensor(b2, device=dev) + (g * torch.tensor(1 - b2, device=dev)) * g}
    runs = {}
    for name in ("torch", "triton"):
        st = [_clone(t) for t in ((p,), (m,), (v,), steps)]
        if name == "torch":
            _torch_step(st[0], [g], st[1], st[2], st[3], None, 0.0)
        else:
            _ours_step(st[0], [g], st[1], st[2], st[3], None, 0.0, {"m": 0, "v": 0}, ok.AdamWTables())
        runs[name] = (st[1][0], st[2][0])
    out = {"elements": elements}
    for name, (mm, vv) in runs.items():
        out[name] = {**{f"m_vs_{k}": _diff([mm], [c]) for k, c in cand_m.items()},
                     **{f"v_vs_{k}": _diff([vv], [c]) for k, c in cand_v.items()}}
        print(f"[op candidates] {name}: {out[name]}", flush=True)
    return out


def timing(dev, ceilings: dict, forms: dict) -> dict:
    shapes = [(VOCAB, HIDDEN)] + [s for _ in range(LAYERS) for s in
                                  ((QKV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER),
                                   (HIDDEN,), (HIDDEN,))] + [(HIDDEN,), (VOCAB, HIDDEN)]
    gen = torch.Generator(device=dev).manual_seed(0)
    ps, ms, vs, steps = _state(shapes, dev, gen, 10.0)
    gs = [torch.randn(s, device=dev, generator=gen) * 1e-3 for s in shapes]
    scale = torch.tensor(1.3, device=dev)
    tables = ok.AdamWTables()
    n = sum(p.numel() for p in ps)

    def torch_fused():
        torch._fused_adamw_(ps, gs, ms, vs, [], steps, amsgrad=False, lr=HYPER["lr"], beta1=HYPER["beta1"],
                            beta2=HYPER["beta2"], weight_decay=0.1, eps=HYPER["eps"], maximize=False,
                            grad_scale=scale, found_inf=None)

    def triton_shard():
        ok.adamw_shard_update(ps, gs, ms, vs, steps, weight_decay=0.1, grad_scale=scale, tables=tables, forms=forms,
                              **HYPER)
    out = {"params": n}
    for name, fn, nbytes in (("torch_fused_adamw", torch_fused, 32), ("triton_shard", triton_shard, 28)):
        ms_ = timed(fn, reps=20)
        floor = nbytes * n / (ceilings["copy_gbps"] * 1e6)
        out[name] = {"gpu_ms": ms_, "bytes_per_param": nbytes, "floor_ms": floor, "ratio": ms_ / floor,
                     "effective_gbps": nbytes * n / (ms_ * 1e6)}
        print(f"[timing] {name}: {out[name]}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 28)
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    ceilings = device_ceilings()
    out = {"bench": "shard_adamw_bench", "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git_commit(),
           "ceilings": ceilings, "defaults": ok.SHARD_FORMS}
    out["op_candidates"] = op_candidates(dev)
    out["scalar_forms"] = scalar_forms(dev)
    best = min(out["scalar_forms"], key=lambda r: r["param"] + r["exp_avg"] + r["exp_avg_sq"])
    base = {**ok.SHARD_FORMS, "bias2": best["bias2"], "bias1": best["bias1"]}
    out["element_forms"] = element_forms(dev, a.elements, a.reps, base)
    out["timing"] = timing(dev, ceilings, ok.SHARD_FORMS)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    name = (f"shard_adamw_bench_{time.strftime('%Y-%m-%dT%H%M', time.gmtime())}_"
            f"{out['device'].replace(' ', '_')}_at_{out['git_commit']}.json")
    Path(__file__).resolve().parent.joinpath("results", name).write_text(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], name).write_text(json.dumps(out, indent=1))
    print(f"\n# shard_adamw_bench on {out['device']} (copy {ceilings['copy_gbps']:.0f} GB/s), defaults "
          f"{ok.SHARD_FORMS}")
    print(f"op candidates (one step, elements differing): {out['op_candidates']}")
    print("scalar forms (bias2, bias1, first step): elements differing in param / m / v")
    for r in out["scalar_forms"]:
        print(f"  {r['bias2']:9s} {r['bias1']:4s} {r['first_step']:6.0f}: {r['param']:8d} {r['exp_avg']:8d} "
              f"{r['exp_avg_sq']:8d}  of {r['elements']}")
    print(f"element forms (base {base}): differing in param / m / v")
    for r in out["element_forms"]:
        print(f"  {r['form']:9s} {str(r['value']):5s}: {r['param']:6d} {r['exp_avg']:6d} {r['exp_avg_sq']:6d}  "
              f"of {r['samples']}")
    for name in ("torch_fused_adamw", "triton_shard"):
        r = out["timing"][name]
        print(f"{name:18s} {r['gpu_ms']:7.2f} ms  floor {r['floor_ms']:6.2f} ms ({r['bytes_per_param']} B/param)  "
              f"{r['ratio']:5.2f}x  {r['effective_gbps']:6.0f} GB/s")
    print(f"wall {out['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
