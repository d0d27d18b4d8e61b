"""torch's fused AdamW over FP32 shards vs training.optim_kernels' `adamw_shard_update` on a GPU: the elements
where the kernel's results differ from torch's kernel (none expected), and the time of each over the 1b model.

FSDP2 keeps FP32 master shards; the overlapped sharded update (training.parallel.LocalFusedAdamW) called
`torch._fused_adamw_` with the clipping factor as `grad_scale`, which divides each gradient as it reads it and
stores it back. The Triton kernel makes the same update without the store (28 B per parameter instead of 32).

  1. Check: 4 steps on odd-sized tensors in two groups (weight decay 0.1 and 0), a learning rate changing every
     step, a grad_scale on every other step, step counters from 1 and from 1000; then `--reps` single steps
     over `--elements` random elements (a rare rounding difference needs many samples to show). Elements of
     param, exp_avg and exp_avg_sq that differ from torch's kernel, and whether the gradients were left alone.
  2. Time: each over the 1b model's parameters (FP32, world size 1: the shards are the whole tensors), with a
     grad_scale, GPU ms (CUDA events) against the floor (32 and 28 B per parameter at the copy bandwidth
     measured in the call).
Prints a table last, writes `bench/results/shard_adamw_bench_<date>_<device>_at_<commit>.json` (and to `$OUT`).

    python bench/shard_adamw_bench.py [--elements 268435456 --reps 4]
"""
from __future__ import annotations

import argparse
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

HYPER = {"lr": 3e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


def _state(shapes, dev, gen, step0: float):
    ps = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in shapes]
    ms = [torch.randn(s, device=dev, generator=gen) * 1e-3 for s in shapes]
    vs = [torch.rand(s, device=dev, generator=gen) * 1e-6 for s in shapes]
    steps = [torch.tensor(step0, device=dev) for _ in shapes]
    return ps, ms, vs, steps


def _clone(ts):
    return [t.clone() for t in ts]


def _torch_step(ps, gs, ms, vs, steps, scale, wd, lr):
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(ps, [g.clone() for g in gs], ms, vs, [], steps, amsgrad=False, lr=lr, beta1=HYPER["beta1"],
                        beta2=HYPER["beta2"], weight_decay=wd, eps=HYPER["eps"], maximize=False, grad_scale=scale,
                        found_inf=None)


def _ours_step(ps, gs, ms, vs, steps, scale, wd, lr, tables):
    torch._foreach_add_(steps, 1)
    ok.adamw_shard_update(ps, gs, ms, vs, steps, lr=lr, beta1=HYPER["beta1"], beta2=HYPER["beta2"],
                          weight_decay=wd, eps=HYPER["eps"], grad_scale=scale, tables=tables)


def _diff(a, b) -> int:
    return sum(int((x.view(torch.int32) != y.view(torch.int32)).sum()) for x, y in zip(a, b))


def check(dev, elements: int, reps: int) -> dict:
    counts = {"param": 0, "exp_avg": 0, "exp_avg_sq": 0}
    grads_untouched = True
    samples = 0

    def compare(ref, ours):
        for key, j in (("param", 0), ("exp_avg", 1), ("exp_avg_sq", 2)):
            counts[key] += _diff(ref[j], ours[j])

    groups = [([(4096, 2048), (3, 2049), (37,)], 0.1), ([(5000,), (2048,)], 0.0)]
    for step0 in (0.0, 999.0):
        gen = torch.Generator(device=dev).manual_seed(int(step0))
        for shapes, wd in groups:
            ref = _state(shapes, dev, gen, step0)
            ours = [_clone(t) for t in ref]
            tables = ok.AdamWTables()
            for k in range(4):
                gs = [torch.randn(s, device=dev, generator=gen) * 10.0 ** (k - 3) for s in shapes]
                kept = _clone(gs)
                scale = torch.tensor(1.0 + 0.37 * k, device=dev) if k % 2 else None
                lr = HYPER["lr"] / (k + 1)
                _torch_step(ref[0], gs, ref[1], ref[2], ref[3], scale, wd, lr)
                _ours_step(ours[0], gs, ours[1], ours[2], ours[3], scale, wd, lr, tables)
                grads_untouched &= all(torch.equal(a, b) for a, b in zip(gs, kept))
                samples += sum(p.numel() for p in ref[0])
            compare(ref, ours)
    for r in range(reps):
        gen = torch.Generator(device=dev).manual_seed(100 + r)
        ref = _state([(elements,)], dev, gen, float(r))
        ours = [_clone(t) for t in ref]
        gs = [torch.randn(elements, device=dev, generator=gen) * 1e-3]
        scale = torch.tensor(1.3, device=dev)
        _torch_step(ref[0], gs, ref[1], ref[2], ref[3], scale, 0.1, HYPER["lr"])
        _ours_step(ours[0], gs, ours[1], ours[2], ours[3], scale, 0.1, HYPER["lr"], ok.AdamWTables())
        compare(ref, ours)
        samples += elements
        del ref, ours, gs
        torch.cuda.empty_cache()
    out = {"element_updates": samples, "differing": counts, "gradients_untouched": grads_untouched}
    print(f"[check] {out}", flush=True)
    return out


def timing(dev, ceilings: dict) -> dict:
    """Both updates over the 1b model's FP32 parameters, unit by unit as the overlapped FSDP2 step calls them
    (the root: embedding, final norm, LM head; then each decoder block's 7 tensors)."""
    layer = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER), (HIDDEN,), (HIDDEN,)]
    unit_shapes = [[(VOCAB, HIDDEN), (HIDDEN,), (VOCAB, HIDDEN)]] + [layer] * LAYERS
    gen = torch.Generator(device=dev).manual_seed(0)
    units = []
    for shapes in unit_shapes:
        ps, ms, vs, steps = _state(shapes, dev, gen, 10.0)
        units.append((ps, [torch.randn(s, device=dev, generator=gen) * 1e-3 for s in shapes], ms, vs, steps))
    scale = torch.tensor(1.3, device=dev)
    tables = ok.AdamWTables()
    n = sum(p.numel() for u in units for p in u[0])

    def torch_fused():
        for ps, gs, ms, vs, steps in units:
            torch._fused_adamw_(ps, gs, ms, vs, [], steps, amsgrad=False, lr=HYPER["lr"], beta1=HYPER["beta1"],
                                beta2=HYPER["beta2"], weight_decay=0.1, eps=HYPER["eps"], maximize=False,
                                grad_scale=scale, found_inf=None)

    def triton_shard():
        for ps, gs, ms, vs, steps in units:
            ok.adamw_shard_update(ps, gs, ms, vs, steps, weight_decay=0.1, grad_scale=scale, tables=tables, **HYPER)
    out = {"params": n, "units": len(units)}
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
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    ceilings = device_ceilings()
    out = {"bench": "shard_adamw_bench", "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git_commit(),
           "ceilings": ceilings}
    out["check"] = check(dev, a.elements, a.reps)
    out["timing"] = timing(dev, ceilings)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    name = (f"shard_adamw_bench_{time.strftime('%Y-%m-%dT%H%M', time.gmtime())}_"
            f"{out['device'].replace(' ', '_')}_at_{out['git_commit']}.json")
    Path(__file__).resolve().parent.joinpath("results", name).write_text(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], name).write_text(json.dumps(out, indent=1))
    print(f"\n# shard_adamw_bench on {out['device']} (copy {ceilings['copy_gbps']:.0f} GB/s)")
    c = out["check"]
    print(f"check against torch._fused_adamw_: {c['element_updates']:,} element updates, differing {c['differing']}, "
          f"gradients untouched: {c['gradients_untouched']}")
    for name in ("torch_fused_adamw", "triton_shard"):
        r = out["timing"][name]
        print(f"{name:18s} {r['gpu_ms']:7.2f} ms  floor {r['floor_ms']:6.2f} ms ({r['bytes_per_param']} B/param)  "
              f"{r['ratio']:5.2f}x  {r['effective_gbps']:6.0f} GB/s")
    print(f"wall {out['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
