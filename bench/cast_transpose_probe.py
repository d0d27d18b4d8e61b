"""fp8_triton's cast-transpose (one pass: W's E4M3 codes in both layouts and its amax) on the 1b step's weight
shapes, alone on a GPU, per tile shape, against what it replaced (inductor's amax-and-cast kernel, then
fp8_transpose's copy of the codes).

In the 1b fp8_delayed step at ca97ee5 the kernel with its 64 x 64 tiles took 2.89 ms per profiled step for the 80
weight casts (~2x their 4 bytes per element), so the one-pass weights gained nothing over the two kernels. This
times each tile shape on [8192, 2048] (gate, up), [2048, 8192] (down), [4096, 2048] (qkv), [2048, 2048] (o), checks
every config's codes, transposed codes and amax equal to torch's cast, and prints ms and x the bytes' floor (the
copy bandwidth measured in the same run). Each timed call reads another of 6 copies of the operand (from HBM, as
in the step: one copy alone stays in L2). Writes $OUT/cast_transpose_probe.json.

    python bench/cast_transpose_probe.py
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchmeta import git_commit  # noqa: E402
from bench.kernel_bench import graph_timed as timed  # noqa: E402
from bench.step_profile import device_ceilings  # noqa: E402
from training.precision.formats import fp8_cast  # noqa: E402
from training.precision.fp8_triton import cast_transpose_launch, fp8_transpose  # noqa: E402

SHAPES = {"gate/up": (8192, 2048), "down": (2048, 8192), "qkv": (4096, 2048), "o": (2048, 2048)}
TILES = [(64, 64, 4), (64, 64, 8), (64, 128, 4), (64, 128, 8), (128, 64, 4), (128, 64, 8), (128, 128, 8),
         (32, 64, 4), (32, 128, 4), (32, 128, 8), (32, 256, 4), (16, 256, 4)]
COPIES = 6  # distinct operands cycled through, so each call reads HBM as in the step (one is under L2's 50 MB)
E4M3 = torch.float8_e4m3fn


def main() -> int:
    dev = torch.device("cuda")
    ceilings = device_ceilings()
    gbps = ceilings["copy_gbps"]
    torch.manual_seed(0)
    rows = []

    @torch.compile(dynamic=False)
    def inductor_cast(w, s):  # the one-pass layer's weight path before: amax along rows then over them, the cast
        return fp8_cast(w, s, E4M3)[0], w.abs().amax(dim=-1).amax().float()

    for label, (m, n) in SHAPES.items():
        ws = [(torch.randn(m, n, device=dev) * 0.02).bfloat16() for _ in range(COPIES)]
        w = ws[0]
        s = torch.tensor(448.0 / 0.1, device=dev)
        turn = iter(range(10 ** 9))

        def nxt():
            return ws[next(turn) % COPIES]
        want_q = fp8_cast(w, s, E4M3)[0].view(torch.uint8)
        want_a = w.abs().amax().float()
        floor_ms = m * n * 4 / gbps / 1e6
        before = timed(lambda: fp8_transpose(inductor_cast(nxt(), s)[0]), calls=4 * COPIES)
        rows.append({"shape": label, "path": "inductor cast + fp8_transpose", "ms": before, "x_floor": before / floor_ms,
                     "equal": True})
        for bm, bn, warps in TILES:
            q, qt, a = cast_transpose_launch(w, s, E4M3, bm=bm, bn=bn, num_warps=warps)
            equal = (torch.equal(q.view(torch.uint8), want_q) and torch.equal(qt.view(torch.uint8), want_q.t())
                     and torch.equal(a, want_a))
            ms = timed(lambda: cast_transpose_launch(nxt(), s, E4M3, bm=bm, bn=bn, num_warps=warps), calls=4 * COPIES)
            rows.append({"shape": label, "path": f"cast_transpose {bm}x{bn} w{warps}", "ms": ms,
                         "x_floor": ms / floor_ms, "equal": equal})
    out = {"bench": "cast_transpose_probe", "git_commit": git_commit(), "device": torch.cuda.get_device_name(),
           "ceilings": ceilings, "rows": rows}
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "cast_transpose_probe.json").write_text(json.dumps(out, indent=1))
    print(f"{'shape':8s} {'path':34s} {'ms':>8s} {'x floor':>8s} equal")
    for r in rows:
        print(f"{r['shape']:8s} {r['path']:34s} {r['ms']:8.4f} {r['x_floor']:8.2f} {r['equal']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
