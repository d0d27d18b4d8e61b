"""The fused MXFP8 quantizer (training/precision/mxfp8_triton.py) on a GPU: launch configurations and the two
rounding paths on the 1b model's operand shapes, each output checked bit for bit against the torch quantizer
(formats.quantize_mxfp8, itself torchao's arithmetic), each timing beside the compiled torch path and, with
`--compare-module`, beside another version of the kernel in the same call. Prints a table, writes
`$OUT/mxfp8_kernel_bench.json`.

    python bench/mxfp8_kernel_bench.py [--compare-module PATH]

Effective bandwidth counts 6 bytes per element (one BF16 read, two BF16 writes), the floor of
bench/NOTES_floor.md.
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
from bench.nvfp4_kernel_bench import _load_module, timed  # noqa: E402
from training.precision import mxfp8_triton as mt  # noqa: E402
from training.precision.formats import quantize_mxfp8  # noqa: E402

# (rows, cols, how many per 1b step): X of qkv/o/gate/up and of down, dY of qkv, o/down, gate/up; the weights
SHAPES = ((8192, 2048, 64), (8192, 8192, 16), (8192, 4096, 16), (8192, 2048, 32), (8192, 8192, 32),
          (4096, 2048, 16), (2048, 2048, 16), (8192, 2048, 32), (2048, 8192, 16))
CONFIGS = [dict(block_n=bn, num_warps=w) for bn, w in itertools.product((64, 128, 256), (2, 4, 8))]


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare-module", default=None, help="another mxfp8_triton.py, timed side by side at its "
                                                           "default launch configuration")
    args = ap.parse_args(argv)
    other = _load_module(args.compare_module) if args.compare_module else None
    dev = torch.device("cuda")
    t0 = time.perf_counter()

    def torch_path(x):
        return (quantize_mxfp8(x, dtype=torch.bfloat16).values,
                quantize_mxfp8(x, axis=0, dtype=torch.bfloat16).values)
    compiled = torch.compile(torch_path)
    g = torch.Generator(device=dev).manual_seed(0)
    rows, seen = [], set()
    for m, n, count in SHAPES:
        if (m, n) in seen:
            continue
        seen.add((m, n))
        x = (torch.randn((m, n), device=dev, generator=g)
             / torch.rand((m, n), device=dev, generator=g).clamp_min(0.02).sqrt()).bfloat16()
        ref_a, ref_b = (r.view(torch.int16) for r in torch_path(x))
        base = {"shape": [m, n], "per_step": sum(c for mm, nn, c in SHAPES if (mm, nn) == (m, n)),
                "torch_compiled_ms": timed(lambda: compiled(x))}
        if other is not None:
            base["compared_ms"] = timed(lambda: other.dual_quantize_launch(x, "rceil"))
        for cfg in CONFIGS:
            row = dict(base, **cfg)
            for path in ("auto", "multiply"):
                a, b = mt.dual_quantize_launch(x, "rceil", path=path, **cfg)
                row[f"mismatch_{path}"] = int((a.view(torch.int16) != ref_a).sum() + (b.view(torch.int16) != ref_b).sum())
                row[f"ms_{path}"] = timed(lambda: mt.dual_quantize_launch(x, "rceil", path=path, **cfg))
                row[f"gbps_{path}"] = x.numel() * 6 / row[f"ms_{path}"] / 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)

    def total(cfg, key):
        return sum(r[key] * r["per_step"] for r in rows if all(r[k] == v for k, v in cfg.items()))
    per_config = [{**c, "step_ms_auto": total(c, "ms_auto"), "step_ms_multiply": total(c, "ms_multiply")}
                  for c in CONFIGS]
    best = min(per_config, key=lambda c: c["step_ms_auto"])
    default = next(c for c in per_config if c["block_n"] == mt.BLOCK_N and c["num_warps"] == mt.NUM_WARPS)
    summary = {"best": best, "default": default,
               "torch_compiled_step_ms": sum(r["torch_compiled_ms"] * r["per_step"] for r in rows) / len(CONFIGS)}
    if other is not None:
        summary["compared_step_ms"] = sum(r["compared_ms"] * r["per_step"] for r in rows) / len(CONFIGS)
    payload = {"bench": "mxfp8_kernel_bench", "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git_commit(),
               "compared_module": args.compare_module, "rows": rows, "summary": summary,
               "wall_s": round(time.perf_counter() - t0, 1)}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "mxfp8_kernel_bench.json").write_text(json.dumps(payload, indent=1))
    print(f"\n{'shape':>11} {'BN':>4} {'W':>2} {'auto ms':>8} {'GB/s':>6} {'mult ms':>8} {'GB/s':>6} {'torch':>7} "
          f"{'compared':>8} {'mis':>4}")
    for r in rows:
        print(f"{r['shape'][0]}x{r['shape'][1]:<6} {r['block_n']:>4} {r['num_warps']:>2} {r['ms_auto']:8.3f} "
              f"{r['gbps_auto']:6.0f} {r['ms_multiply']:8.3f} {r['gbps_multiply']:6.0f} {r['torch_compiled_ms']:7.3f} "
              f"{r.get('compared_ms', float('nan')):8.3f} {r['mismatch_auto'] + r['mismatch_multiply']:>4}")
    print("per 1b step (ms, operand counts weighted):", json.dumps(summary))
    print(f"wall {payload['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
