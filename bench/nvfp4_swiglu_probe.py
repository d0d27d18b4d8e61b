"""NVFP4's fused SwiGLU pass (training/precision/nvfp4_swiglu_triton.py) on a GPU against what it replaces, on the 1b
model's MLP shape (8192 tokens x 8192), with the host out of the measurement.

In the layers' path inductor computes h = silu(G s_g) (U s_u) (forward) or dL/dgate and dL/dup (backward) in one
pointwise kernel, and the quantizer's amax pass then reads each result once more for max |v| and max |RHT(v)|. The fused
pass computes the same values and both maxima in one kernel. Here: inductor's kernel (torch.compile of the layers' math)
plus the amax pass(es), against the fused kernel at several tiles (BLOCK_N:GROUPS:WARPS), with the BF16 rounding done by
the conversion instruction (`native`) or on the bits, and with the RHT's product taken as the amax pass takes it or
transposed (` T`, as the quantize pass: one wgmma with M = BLOCK_N). Each variant's 20 calls are captured in one CUDA
graph and replayed between CUDA events (bench.kernel_bench.graph_timed). Every fused variant is checked against
inductor's values and the amax pass's maxima, to the bit.

    python bench/nvfp4_swiglu_probe.py [--configs 128:2:4 64:2:4 ...]

Prints a table last (ms per launch, and per 1b step: 16 layers, one forward and one backward each); writes
bench/results/nvfp4_swiglu_probe_<device>_<time>.json (and $OUT/nvfp4_swiglu_probe.json)."""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.nvfp4_quant_probe import config_arg  # noqa: E402

CONFIGS = ((128, 2, 4), (128, 1, 4), (64, 2, 4), (128, 2, 8), (256, 1, 8), (128, 4, 8), (64, 1, 2))
LAYERS = 16  # the 1b model's MLPs: one forward and one backward pass each per step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", type=config_arg, default=list(CONFIGS),
                    help="fused-pass tiles BLOCK_N:GROUPS:WARPS (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--features", type=int, default=8192)
    a = ap.parse_args(argv)
    if a.tokens % 16 or a.features % 16 or a.tokens <= 0 or a.features <= 0:
        ap.error("--tokens and --features: positive multiples of 16")

    import json

    import torch

    from bench.benchmeta import git_commit, write_result
    from bench.kernel_bench import graph_timed
    from training.precision.formats import random_sign_vector, rht_matrix
    from training.precision.nvfp4_swiglu_triton import swiglu_launch
    from training.precision.nvfp4_triton import amax_launch, rht_operand

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (a.tokens, a.features)
    g, u, dh = ((torch.randn(shape, device=dev, generator=gen) * s).bfloat16() for s in (4e4, 30.0, 3e3))
    s_g, s_u, s_dh = (torch.tensor([v], device=dev) for v in (1.7e-4, 3.1e-3, 2.3e-7))
    rht_t = rht_operand(rht_matrix(random_sign_vector(0)).to(dev), dev)

    @torch.compile
    def fwd(g, u, s_g, s_u):  # the layers' path as the compiled step traces it (emulated_mm's rounding dropped)
        return torch.nn.functional.silu((g.float() * s_g).to(torch.bfloat16)) * (u.float() * s_u).to(torch.bfloat16)

    @torch.compile
    def bwd(g, u, dh, s_g, s_u, s_dh):
        gs, us = (g.float() * s_g).to(torch.bfloat16), (u.float() * s_u).to(torch.bfloat16)
        dhs = (dh.float() * s_dh).to(torch.bfloat16)
        return torch.ops.aten.silu_backward(dhs * us, gs), dhs * torch.nn.functional.silu(gs)

    def old_fwd():
        h = fwd(g, u, s_g, s_u)
        return h, amax_launch(h, rht_t, True)

    def old_bwd():
        dg, du = bwd(g, u, dh, s_g, s_u, s_dh)
        return dg, du, torch.cat([amax_launch(dg, rht_t, True), amax_launch(du, rht_t, True)])

    ref_fwd, ref_bwd = old_fwd(), old_bwd()
    rows = [{"variant": "inductor + amax pass", "direction": d, "ms": graph_timed(fn, reps=5), "same_bits": True}
            for d, fn in (("forward", old_fwd), ("backward", old_bwd))]
    print(json.dumps(rows[0]), json.dumps(rows[1]), flush=True)

    def same(xs, ys):
        return all(torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x, y.view(torch.int16)
                               if y.dtype == torch.bfloat16 else y) for x, y in zip(xs, ys))

    for native, transposed in ((True, False), (True, True), (False, False)):
        for bn, groups, warps in a.configs:
            cfg = dict(block_n=bn, groups=groups, num_warps=warps, native=native, transposed=transposed)
            label = f"fused {bn}:{groups}:{warps}{'' if native else ' bits'}{' T' if transposed else ''}"
            for direction in ("forward", "backward"):
                if direction == "forward":
                    def fn():
                        return swiglu_launch(g, u, None, s_g, s_u, None, rht_t, True, **cfg)
                    ref = ref_fwd
                else:
                    def fn():
                        return swiglu_launch(g, u, dh, s_g, s_u, s_dh, rht_t, True, **cfg)
                    ref = ref_bwd
                row = {"variant": label, "direction": direction, **cfg, "same_bits": same(fn(), ref),
                       "ms": graph_timed(fn, reps=5)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    bytes_fwd, bytes_bwd = 3 * 2 * g.numel(), 5 * 2 * g.numel()  # BF16 in and out, once each
    x = torch.empty(256 * 2 ** 20, device=dev, dtype=torch.uint8)
    y = torch.empty_like(x)
    copy_ms = graph_timed(lambda: y.copy_(x), reps=5)
    copy_tbps = 2 * x.numel() / copy_ms / 1e9
    table = {}
    for r in rows:
        t = table.setdefault(r["variant"], {"same_bits": True})
        t[r["direction"]] = r["ms"]
        t["same_bits"] &= r["same_bits"]
    for t in table.values():
        t["ms_per_1b_step"] = LAYERS * (t["forward"] + t["backward"])
    payload = {"bench": "nvfp4_swiglu_probe", "device": torch.cuda.get_device_name(dev),
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
               "shape": list(shape), "copy_tbps": copy_tbps,
               "floor_ms": {"forward": bytes_fwd / copy_tbps / 1e9, "backward": bytes_bwd / copy_tbps / 1e9},
               "rows": rows, "table": table}
    write_result(payload, "nvfp4_swiglu_probe", torch.cuda.get_device_name(dev))
    fl = payload["floor_ms"]
    print(f"\n{shape[0]} x {shape[1]} on {payload['device']}; copy {copy_tbps:.2f} TB/s, bytes' floor forward "
          f"{fl['forward']:.4f} ms, backward {fl['backward']:.4f} ms (fused pass; the old path also re-reads)")
    print(f"{'variant':>26} {'forward ms':>11} {'backward ms':>12} {'ms per 1b step':>15} {'bits':>5}")
    for name, t in table.items():
        print(f"{name:>26} {t['forward']:11.4f} {t['backward']:12.4f} {t['ms_per_1b_step']:15.3f} "
              f"{'same' if t['same_bits'] else 'DIFF':>5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
