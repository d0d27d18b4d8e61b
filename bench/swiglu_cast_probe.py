"""fp8_delayed's SwiGLU backward + E5M2 cast, alone on a GPU: inductor's kernel against hand-written Triton.

In fp8_delayed's compiled 1b step the MLP's backward runs one inductor kernel per layer that reads the gate/up
GEMM output (BF16, [tokens, 2 I]) and dL/dh (BF16, [tokens, I]), forms d(gate) and d(up), records their amax and
writes their E5M2 codes for the gate_up layer's Dgrad; the Wgrad layout is then copied from the codes
(fp8_triton.fp8_transpose). On an H100 that kernel took 0.276 ms per layer against ~0.18 ms for its bytes
(bench/NOTES_floor.md 47, 49). This probe times, on the 1b shape (8192 tokens, I = 8192):

  * inductor: the layer's own ops (chunk, silu, mul, autograd's backward, row-then-total amax, fp8_cast)
    compiled as one function, as in the step; then fp8_transpose;
  * triton_rows: one hand-written pass writing the row-major codes and per-program amax partials; then
    fp8_transpose;
  * triton_both: one hand-written pass writing both layouts (the transposed one from the same tile).

Each checked against the inductor codes (mismatching codes counted; a code differs only where the FP32 math
rounds differently) and the amax. Floor: the bytes at the copy bandwidth measured in the same run. Prints a
table, writes $OUT/swiglu_cast_probe.json. Also dumps inductor's generated kernel source for the record.

    python bench/swiglu_cast_probe.py [--tokens 8192 --inter 8192]
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
from bench.kernel_bench import graph_timed as timed  # noqa: E402
from bench.step_profile import device_ceilings  # noqa: E402
from training.precision.formats import fp8_cast  # noqa: E402
from training.precision.fp8_triton import fp8_transpose  # noqa: E402
from training.triton_math import HAVE_TRITON  # noqa: E402

E5M2 = torch.float8_e5m2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from training.triton_math import fp8_code

    @triton.jit
    def _swiglu_bwd_cast_kernel(gu_ptr, dh_ptr, scale_ptr, q_ptr, qt_ptr, partial_ptr, M, I,
                                BM: tl.constexpr, BN: tl.constexpr, BOTH: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < I)
        r = rows[:, None].to(tl.int64)
        g = tl.load(gu_ptr + r * (2 * I) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + r * (2 * I) + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + r * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        du = dh * (g * sig)  # dh * silu(g)
        dg = ((dh * u) * sig) * (1.0 + g * (1.0 - sig))  # aten.silu_backward's decomposition
        amax = tl.maximum(tl.max(tl.max(tl.abs(dg), axis=1), axis=0), tl.max(tl.max(tl.abs(du), axis=1), axis=0))
        tl.store(partial_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), amax)
        s = tl.load(scale_ptr)
        cg = fp8_code(dg * s, 57344.0, True).to(tl.float8e5, bitcast=True)
        cu = fp8_code(du * s, 57344.0, True).to(tl.float8e5, bitcast=True)
        tl.store(q_ptr + r * (2 * I) + cols[None, :], cg, mask=mask)
        tl.store(q_ptr + r * (2 * I) + I + cols[None, :], cu, mask=mask)
        if BOTH:
            c = cols[:, None].to(tl.int64)
            tl.store(qt_ptr + c * M + rows[None, :], tl.trans(cg), mask=tl.trans(mask))
            tl.store(qt_ptr + (c + I) * M + rows[None, :], tl.trans(cu), mask=tl.trans(mask))


def triton_cast(gu, dh, scale, both: bool, bm: int, bn: int, warps: int):
    m, i = dh.shape
    q = torch.empty((m, 2 * i), device=dh.device, dtype=E5M2)
    qt = torch.empty((2 * i, m), device=dh.device, dtype=E5M2) if both else q
    grid = (triton.cdiv(m, bm), triton.cdiv(i, bn))
    partial = torch.empty(grid[0] * grid[1], device=dh.device, dtype=torch.float32)
    _swiglu_bwd_cast_kernel[grid](gu, dh, scale, q, qt, partial, m, i, BM=bm, BN=bn, BOTH=both, num_warps=warps)
    return q, (qt if both else None), partial.amax()


def inductor_graph(gu, dh, scale):
    """The ops of the step's backward: h = silu(gate) * up differentiated (mul's backward, then
    aten.silu_backward, as AOTAutograd traces them), the gate_up layer's row-then-total amax and E5M2 cast."""
    gate, up = gu.chunk(2, dim=-1)
    du = dh * torch.nn.functional.silu(gate)
    dg = torch.ops.aten.silu_backward(dh * up, gate)
    d = torch.cat([dg, du], dim=-1)
    amax = d.abs().amax(dim=-1).amax().float()
    return fp8_cast(d, scale, E5M2)[0], amax


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--inter", type=int, default=8192)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    cache = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/plab_probe_inductor"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    ceilings = device_ceilings()
    gen = torch.Generator(device=dev).manual_seed(0)
    m, i = args.tokens, args.inter
    gu = torch.randn((m, 2 * i), device=dev, generator=gen).to(torch.bfloat16) * 2
    dh = (torch.randn((m, i), device=dev, generator=gen) * 1e-3).to(torch.bfloat16)
    scale = torch.tensor(57344.0 / 0.05, device=dev)

    compiled = torch.compile(inductor_graph, fullgraph=True)
    t0 = time.time()
    q_ref, amax_ref = compiled(gu, dh, scale)
    compile_s = time.time() - t0
    qt_ref = fp8_transpose(q_ref)
    bytes_rows = 3 * m * i * 2 + 2 * m * i
    floor = lambda nbytes: nbytes / (ceilings["copy_gbps"] * 1e6)  # noqa: E731
    rows = []

    def row(name, fn, nbytes, q=None, qt=None, amax=None):
        ms = timed(fn, reps=50)
        r = {"variant": name, "ms": ms, "floor_ms": floor(nbytes), "x_floor": ms / floor(nbytes)}
        if q is not None:
            r["code_mismatches"] = int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
            r["amax_equal"] = bool(amax == amax_ref)
        if qt is not None:
            r["qt_mismatches"] = int((qt.view(torch.uint8) != qt_ref.view(torch.uint8)).sum())
        rows.append(r)

    tbytes = 2 * (2 * m * i)
    row("inductor", lambda: compiled(gu, dh, scale), bytes_rows)
    row("fp8_transpose", lambda: fp8_transpose(q_ref), tbytes)
    row("inductor + fp8_transpose", lambda: fp8_transpose(compiled(gu, dh, scale)[0]), bytes_rows + tbytes)
    for bm, bn, warps in ((1, 2048, 8), (2, 1024, 4), (4, 1024, 8), (8, 512, 8), (16, 256, 4)):
        q, _, amax = triton_cast(gu, dh, scale, False, bm, bn, warps)
        row(f"triton_rows {bm}x{bn} w{warps}", lambda: triton_cast(gu, dh, scale, False, bm, bn, warps), bytes_rows,
            q, None, amax)
    for bm, bn, warps in ((64, 64, 4), (64, 128, 4), (128, 64, 8), (128, 128, 8), (32, 128, 4)):
        q, qt, amax = triton_cast(gu, dh, scale, True, bm, bn, warps)
        row(f"triton_both {bm}x{bn} w{warps}", lambda: triton_cast(gu, dh, scale, True, bm, bn, warps),
            bytes_rows + 2 * m * i, q, qt, amax)

    # The kernel fp8_delayed's fused_swiglu runs (training/precision/fp8_swiglu_triton.py): backward with two
    # gradients of one dL/dh (gate's and up's, each its own scale and amax), forward from g and u; both layouts.
    from training.precision import fp8_swiglu_triton as fs

    g, u = gu[:, :i].contiguous(), gu[:, i:].contiguous()
    bwd_bytes = 3 * m * i * 2 + 2 * 2 * m * i
    fwd_bytes = 2 * m * i * 2 + 2 * m * i
    for bm, bn, warps in ((32, 128, 4), (16, 128, 4), (32, 64, 4), (64, 64, 4), (32, 256, 8)):
        out = fs.swiglu_fp8_launch(g, u, dh, scale, scale, bm=bm, bn=bn, num_warps=warps)
        row(f"module bwd {bm}x{bn} w{warps}", lambda: fs.swiglu_fp8_launch(g, u, dh, scale, scale, bm=bm, bn=bn,
                                                                         num_warps=warps), bwd_bytes,
            torch.cat([out[0], out[3]], dim=1), None, torch.maximum(out[2], out[5]))
        row(f"module fwd {bm}x{bn} w{warps}", lambda: fs.swiglu_fp8_launch(g, u, None, scale, None, bm=bm, bn=bn,
                                                                         num_warps=warps), fwd_bytes)

    # inductor's generated kernels, for the record
    sources = {}
    for p in cache.rglob("*.py"):
        text = p.read_text(errors="replace")
        if "silu" in text and "@triton.jit" in text:
            sources[p.name] = text[:20000]
    out = {"bench": "swiglu_cast_probe", "device": torch.cuda.get_device_name(dev),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(), "tokens": m, "inter": i,
           "ceilings": ceilings, "compile_s": compile_s, "rows": rows, "inductor_sources": sources}
    dest = Path(os.environ.get("OUT", ".")) / "swiglu_cast_probe.json"
    dest.write_text(json.dumps(out, indent=1))
    print(f"\n# swiglu_cast_probe on {out['device']}, copy {ceilings['copy_gbps']:.0f} GB/s, {m} x {i}")
    print(f"{'variant':34s} {'ms':>7s} {'floor':>7s} {'x':>5s} {'codes!=':>8s} {'qt!=':>8s} amax")
    for r in rows:
        print(f"{r['variant']:34s} {r['ms']:7.3f} {r['floor_ms']:7.3f} {r['x_floor']:5.2f} "
              f"{r.get('code_mismatches', ''):>8} {r.get('qt_mismatches', ''):>8} {r.get('amax_equal', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
