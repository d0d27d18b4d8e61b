"""Current scaling's amax-only passes, alone on a GPU: the tile that reads fastest.

fp8_tensorwise's fused MLP and QKV projection (options fused_swiglu, fused_qkv_rope) run fp8_delayed's one-pass
kernels twice per operand: first with their stores compiled out, for the amax (fp8_swiglu_triton.swiglu_amax,
fp8_rope_triton.rope_bwd_amax), then for the codes. The first pass runs the codes pass's tile (SwiGLU 32 x 128 with
4 warps; RoPE 32 tokens x one head). In the 1b step on an H200 the SwiGLU amax passes took ~3.4 ms, ~3.2 TB/s, for
10.7 GB read (bench/NOTES_floor.md 80). A pure reduction may want more bytes in flight per program. This probe times
each pass on the 1b shape (8192 tokens; I = 8192; 16 query heads, 8 KV heads, head_dim 128) for several tiles. Each
tile's amax must equal the default tile's (the max does not depend on the tiling). Each is compared with the copy
ceiling measured in the same run.

`--codes` also times the codes passes (the stores on: what fp8_delayed runs alone and fp8_tensorwise after the amax
pass) for the same tiles, each tile's codes, both layouts, and amaxes compared to the bit with the first tile's (the
codes pass's tile was chosen on an H100, bench/NOTES_floor.md 47-49). Floors: SwiGLU forward reads g and u and writes
h's codes twice (6 bytes an element), backward reads dh too and writes two operands' codes twice (10); RoPE's reads
dY and writes its codes twice (4).

GPU time per call from CUDA graphs (bench.kernel_bench.graph_timed). Prints a table; writes
bench/results/amax_pass_probe_<device>_<time>.json (and $OUT/amax_pass_probe.json).

    python bench/amax_pass_probe.py [--codes] [--tokens 8192 --inter 8192 --heads 16 --kv-heads 8 --head-dim 128]
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (BM, BN, warps) for the SwiGLU passes; (BM, warps) for RoPE's: the codes pass's tile first
SWIGLU_TILES = ((32, 128, 4), (64, 128, 4), (64, 128, 8), (32, 256, 4), (64, 256, 8), (128, 128, 8), (128, 256, 8))
ROPE_TILES = ((32, 4), (64, 4), (64, 8), (128, 8))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--codes", action="store_true", help="also time the codes passes (stores on) per tile")
    a = ap.parse_args(argv)

    import torch

    from bench.benchmeta import git_commit, write_result
    from bench.kernel_bench import graph_timed
    from bench.step_profile import device_ceilings
    from training.precision import fp8_rope_triton as fr
    from training.precision import fp8_swiglu_triton as fs

    if not torch.cuda.is_available():
        print("needs a GPU (Triton kernels timed from CUDA graphs)")
        return 2
    torch.manual_seed(0)
    m, n = a.tokens, a.inter
    g = (torch.randn(m, n, device="cuda") * 4).bfloat16()
    u = torch.randn(m, n, device="cuda").bfloat16()
    dh = (torch.randn(m, n, device="cuda") * 1e-3).bfloat16()
    b, d = 4, a.head_dim
    t = m // b
    grads = [(torch.randn(b, t, h, d, device="cuda") * 1e-3).bfloat16() for h in (a.heads, a.kv_heads, a.kv_heads)]
    cos, sin = (torch.randn(1, t, d, device="cuda").bfloat16() for _ in range(2))
    ceilings = device_ceilings()
    gbps = ceilings["copy_gbps"]
    rows, want = [], {}

    def run(name, tile, fn, nbytes):
        out = fn()
        out = out if isinstance(out, tuple) else (out,)
        amax = [float(v) for v in out if v.dim() == 0]
        codes = [v.view(torch.uint8) for v in out if v.dim() > 0]
        first = want.setdefault(name, (amax, codes))
        same = amax == first[0] and all(torch.equal(c, f) for c, f in zip(codes, first[1]))
        ms = graph_timed(fn)
        rows.append({"pass": name, "tile": list(tile), "ms": ms, "gb_moved": nbytes / 1e9,
                     "floor_ms": nbytes / gbps / 1e6, "vs_floor": ms / (nbytes / gbps / 1e6),
                     "amax": amax, "same_amax": same})

    for tile in SWIGLU_TILES:
        bm, bn, warps = tile
        run("swiglu_fwd", tile, lambda: fs.swiglu_fp8_launch(g, u, None, None, None, store=False, bm=bm, bn=bn,
                                                             num_warps=warps), 4 * m * n)
        run("swiglu_bwd", tile, lambda: fs.swiglu_fp8_launch(g, u, dh, None, None, store=False, bm=bm, bn=bn,
                                                             num_warps=warps), 6 * m * n)
    if a.codes:  # scales from the amaxes, as current scaling takes them
        s_h = 448.0 / fs.swiglu_fp8_launch(g, u, None, None, None, store=False).float().reshape(1)
        s_dg, s_du = (57344.0 / v.float().reshape(1) for v in fs.swiglu_fp8_launch(g, u, dh, None, None, store=False))
        for tile in SWIGLU_TILES:
            bm, bn, warps = tile
            run("swiglu_fwd_codes", tile, lambda: fs.swiglu_fp8_launch(g, u, None, s_h, None, bm=bm, bn=bn,
                                                                       num_warps=warps), 6 * m * n)
            run("swiglu_bwd_codes", tile, lambda: fs.swiglu_fp8_launch(g, u, dh, s_dg, s_du, bm=bm, bn=bn,
                                                                       num_warps=warps), 10 * m * n)
    rope_bytes = 2 * m * (a.heads + 2 * a.kv_heads) * d
    for tile in ROPE_TILES:
        bm, warps = tile
        run("rope_bwd", tile, lambda: fr.rope_bwd_fp8_launch(*grads, cos, sin, None, store=False, bm=bm,
                                                             num_warps=warps), rope_bytes)
    if a.codes:
        s_rope = 57344.0 / fr.rope_bwd_fp8_launch(*grads, cos, sin, None, store=False).float().reshape(1)
        for tile in ROPE_TILES:
            bm, warps = tile
            run("rope_bwd_codes", tile, lambda: fr.rope_bwd_fp8_launch(*grads, cos, sin, s_rope, bm=bm,
                                                                       num_warps=warps, rounded=True), 2 * rope_bytes)
    summary = {"bench": "amax_pass_probe", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "git_commit": git_commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "shape": vars(a), "ceilings": ceilings, "rows": rows}
    print(f"copy ceiling {gbps:.0f} GB/s")
    print(f"{'pass':16s} {'tile':>14s} {'ms':>8s} {'floor':>8s} {'ratio':>6s}  amax")
    for r in rows:
        tile = "x".join(str(v) for v in r["tile"])
        same = "" if r["same_amax"] else "  DIFFERS from the first tile's"
        print(f"{r['pass']:16s} {tile:>14s} {r['ms']:8.4f} {r['floor_ms']:8.4f} {r['vs_floor']:6.2f}  "
              f"{r['amax']}{same}")
    write_result(summary, "amax_pass_probe", torch.cuda.get_device_name())
    return 0 if all(r["same_amax"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
