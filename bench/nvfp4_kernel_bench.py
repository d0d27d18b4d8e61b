"""The fused NVFP4 quantizers (training/precision/nvfp4_triton.py) on a GPU: launch configurations swept on
the 1b model's operand shapes, each checked against the torch quantizers and timed against the compiled
torch path that produces the same two operands (what the emulation ran before). Prints a table, writes
`$OUT/nvfp4_kernel_bench.json`.

    python bench/nvfp4_kernel_bench.py [--configs default|sweep] [--compare-module PATH]

`--compare-module` times another version of nvfp4_triton.py (e.g. `git show REF:training/precision/
nvfp4_triton.py > /tmp/prev.py`) on the same operands in the same call: the before/after of a kernel change
as a ratio measured side by side.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchmeta import git_commit  # noqa: E402
from training.precision import nvfp4_triton as nt  # noqa: E402
from training.precision.formats import (quantize_nvfp4, random_hadamard_transform, random_sign_vector,  # noqa: E402
                                        rht_matrix)

SHAPES = ((8192, 2048), (8192, 4096), (8192, 8192))  # tokens x features of X and dY in the 1b model
CONFIGS = [dict(block_n=bn, groups=g, num_warps=w) for bn, g, w in itertools.product((64, 128, 256, 512), (1, 4), (4, 8))]


def timed(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _timed_launch(module, x, h, seed, sr: bool, cfg: dict):
    """ms of one module's launch, or None where the module rejects the configuration (earlier versions of the
    kernel required block_n multiples of 64 or 128 for stochastic rounding)."""
    try:
        module.dual_quantize_launch(x, h, seed, True, sr, **cfg)
    except ValueError as e:
        print(f"skipped: {cfg} {'sr' if sr else 'rne'}: {e}", flush=True)
        return None
    return timed(lambda: module.dual_quantize_launch(x, h, seed, True, sr, **cfg))


def _timed_amax(module, x, h, bn=None, groups=None, warps=None) -> float:
    """ms of the amax pass alone (its kernel and the reduction of its partial maxima), at the module's own tile
    unless given."""
    import triton

    m, n = x.shape
    bn, groups = bn or module.AMAX_BLOCK_N, groups or module.AMAX_GROUPS
    grid = (triton.cdiv(m, 16 * groups), triton.cdiv(n, bn))
    partial = torch.empty((grid[0] * grid[1], 2), device=x.device, dtype=torch.float32)

    def run():
        module._nvfp4_dual_amax_kernel[grid](x, h, partial, m, n, x.stride(0), BLOCK=bn, GROUPS=groups, HAS_RHT=True,
                                              DOT_BF16=True, num_warps=warps or module.NUM_WARPS)
        return partial.amax(dim=0)
    return timed(run)


def _load_module(path: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location("nvfp4_triton_compared", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", choices=["default", "sweep"], default="sweep",
                    help="default: the launch configuration training uses per shape; sweep: all of CONFIGS")
    ap.add_argument("--compare-module", default=None, help="another nvfp4_triton.py, timed side by side")
    ap.add_argument("--amax-sweep", action="store_true",
                    help="also time the amax pass alone over tiles (features x 16-token groups) and warps")
    args = ap.parse_args(argv)
    other = _load_module(args.compare_module) if args.compare_module else None
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    m = rht_matrix(random_sign_vector(0)).to(dev)
    h = nt.rht_operand(m, dev)

    def torch_path(x, stochastic: bool):
        a = quantize_nvfp4(x, stochastic=stochastic, dtype=torch.bfloat16)
        b = quantize_nvfp4(random_hadamard_transform(x, m, axis=0, dtype=torch.bfloat16), axis=0,
                           stochastic=stochastic, dtype=torch.bfloat16)
        return a.values, b.values, a.outer, b.outer

    compiled = torch.compile(torch_path)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    amax_sweep: dict = {}
    for shape in SHAPES:
        x = (torch.randn(shape, device=dev, generator=g)
             / torch.rand(shape, device=dev, generator=g).clamp_min(0.02).sqrt()).bfloat16()
        ref_a = quantize_nvfp4(x, dtype=torch.bfloat16)
        ref_b = quantize_nvfp4(random_hadamard_transform(x, m, axis=0, dtype=torch.float32), axis=0,
                               dtype=torch.bfloat16)
        base = {sr: timed(lambda: compiled(x, sr)) for sr in (False, True)}
        amax_ms = {"amax_ms": _timed_amax(nt, x, h)}
        if other is not None:
            amax_ms["compared_amax_ms"] = _timed_amax(other, x, h)
            amax_ms["amax_ms"] = min(amax_ms["amax_ms"], _timed_amax(nt, x, h))
        print(f"amax pass alone, {shape[0]}x{shape[1]}: " + ", ".join(f"{k} {v:.4f}" for k, v in amax_ms.items()),
              flush=True)
        if args.amax_sweep:
            sweep = {f"{bn}x{g}x{w}": _timed_amax(nt, x, h, bn, g, w)
                     for bn, g, w in itertools.product((128, 256, 512), (1, 2, 4, 8), (4, 8))}
            amax_sweep[f"{shape[0]}x{shape[1]}"] = sweep
            print(f"  amax sweep (features x groups x warps), best: "
                  + ", ".join(f"{k} {v:.4f}" for k, v in sorted(sweep.items(), key=lambda kv: kv[1])[:4]), flush=True)
        configs = CONFIGS if args.configs == "sweep" else [nt.launch_config(shape[1], sr) for sr in (False, True)]
        for cfg in configs:
            seed0 = torch.zeros(1, device=dev, dtype=torch.int64)
            a, b, pts = nt.dual_quantize_launch(x, h, seed0, True, False, **cfg)
            row = {"shape": list(shape), **cfg, **amax_ms,
                   "a_bit_mismatch_frac": float((a.view(torch.int16) != ref_a.values.view(torch.int16)).float().mean()),
                   "a_scale_equal": bool(torch.equal(pts[0], ref_a.outer)),
                   "b_bit_mismatch_frac": float((b.view(torch.int16) != ref_b.values.view(torch.int16)).float().mean()),
                   "b_scale_equal": bool(torch.equal(pts[1], ref_b.outer))}
            for sr in (False, True):
                seed = torch.randint(0, 2 ** 31 - 1, (1,), device=dev)
                key = 'sr' if sr else 'rne'
                ms = _timed_launch(nt, x, h, seed, sr, cfg)
                row[f"torch_compiled_ms_{key}"] = base[sr]
                if other is not None:
                    row[f"compared_ms_{key}"] = _timed_launch(other, x, h, seed, sr, cfg)
                    if row[f"compared_ms_{key}"] is not None and ms is not None:
                        # same seed: a kernel change that keeps the arithmetic gives the same bits (Philox draws too)
                        mine = nt.dual_quantize_launch(x, h, seed, True, sr, **cfg)
                        theirs = other.dual_quantize_launch(x, h, seed, True, sr, **cfg)
                        row[f"same_bits_as_compared_{key}"] = [
                            bool(torch.equal(p.view(torch.int16), q.view(torch.int16))) if p.dtype == torch.bfloat16
                            else bool(torch.equal(p, q)) for p, q in zip(mine, theirs)]
                    if ms is not None:
                        ms = min(ms, _timed_launch(nt, x, h, seed, sr, cfg))
                row[f"ms_{key}"] = ms
                row[f"gbps_{key}"] = None if ms is None else x.numel() * 2 * 4 / ms / 1e6  # read x twice, write a, b
            rows.append(row)
            print(json.dumps(row), flush=True)
    best = {}
    for shape in SHAPES:
        cand = [r for r in rows if r["shape"] == list(shape)]
        for key in ("ms_rne", "ms_sr"):
            r = min((r for r in cand if r[key] is not None), key=lambda r: r[key])
            best[f"{shape[0]}x{shape[1]}_{key}"] = {k: r[k] for k in ("block_n", "groups", "num_warps", key)}
    if other is not None:
        for key in ("rne", "sr"):
            both = [r for r in rows if r["ms_" + key] is not None and r["compared_ms_" + key] is not None]
            print(f"{key}: this module / compared module = "
                  f"{sum(r['ms_' + key] for r in both) / sum(r['compared_ms_' + key] for r in both):.3f} "
                  f"(summed over the {len(both)} shape x config rows both modules run)")
            for key2, mod in (("ms_", "this module"), ("compared_ms_", "compared module")):
                best_ms = {tuple(r["shape"]): min(q[key2 + key] for q in rows if q["shape"] == r["shape"]
                                                  and q[key2 + key] is not None) for r in rows}
                print(f"  {mod}, best config per shape: " + ", ".join(f"{s[0]}x{s[1]} {v:.3f} ms"
                                                                      for s, v in best_ms.items()))
    runnable = [c for c in (CONFIGS if args.configs == "sweep" else configs)
                if all(r["ms_rne"] is not None and r["ms_sr"] is not None
                       for r in rows if all(r[k] == v for k, v in c.items()))]
    overall = min(runnable, key=lambda c: sum(r["ms_rne"] + r["ms_sr"] for r in rows
                                              if all(r[k] == v for k, v in c.items())))
    payload = {"bench": "nvfp4_kernel_bench", "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git_commit(),
               "compared_module": args.compare_module, "rows": rows, "amax_sweep": amax_sweep, "best": best, "best_overall": overall, "wall_s": round(time.perf_counter() - t0, 1)}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "nvfp4_kernel_bench.json").write_text(json.dumps(payload, indent=1))
    print(f"\n{'shape':>11} {'BN':>4} {'G':>2} {'W':>2} {'rne ms':>7} {'GB/s':>6} {'sr ms':>7} {'GB/s':>6} "
          f"{'torch rne':>9} {'torch sr':>8} {'a mis':>7} {'b mis':>7}")
    def f(v, fmt):  # a rejected configuration prints as "-"
        return format(v, fmt) if v is not None else format("-", ">" + fmt.split(".")[0].lstrip(">"))

    for r in rows:
        print(f"{r['shape'][0]}x{r['shape'][1]:<6} {r['block_n']:>4} {r['groups']:>2} {r['num_warps']:>2} "
              f"{f(r['ms_rne'], '7.3f')} {f(r['gbps_rne'], '6.0f')} {f(r['ms_sr'], '7.3f')} {f(r['gbps_sr'], '6.0f')} "
              f"{r['torch_compiled_ms_rne']:9.3f} {r['torch_compiled_ms_sr']:8.3f} "
              f"{r['a_bit_mismatch_frac']:7.1e} {r['b_bit_mismatch_frac']:7.1e}"
              + (f"  compared {f(r['compared_ms_rne'], '7.3f')} {f(r['compared_ms_sr'], '7.3f')}"
                 if other is not None else ""))
    if other is not None:
        for key in ("rne", "sr"):
            checked = [r[f"same_bits_as_compared_{key}"] for r in rows if f"same_bits_as_compared_{key}" in r]
            print(f"{key}: (a, b, pts) bit-identical to the compared module's with the same seed in "
                  f"{sum(all(c) for c in checked)} of {len(checked)} rows; per output: "
                  f"{[sum(c[i] for c in checked) for i in range(3)]}")
    print(f"best overall: {overall}; wall {payload['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
