"""Where the memset before each FP8 GEMM comes from, and what it costs: torch._scaled_mm on the 1b step's GEMM shapes,
alone on a GPU.

In fp8_delayed's step profile (bench/NOTES_floor.md 52) ~190 memsets per step sit right before the FP8 GEMMs, each
followed by ~3.5 us of idle GPU under CUDA graphs (~0.7 ms a step); BF16's GEMMs have 16. This runs each GEMM of a
layer (Fprop with fast accumulation, Dgrad and Wgrad without, E4M3 x E4M3 or E5M2 x E4M3, BF16 out) in a child
process per cuBLASLt workspace setting (torch's CUBLASLT_WORKSPACE_SIZE, KiB), and reports per GEMM: the kernel
cuBLASLt picked, memsets per call (profiler, eager), and GPU ms per call from a CUDA graph of 20 calls.

    python bench/scaled_mm_memset_probe.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {"default": None, "ws_0": "0", "ws_1MiB": "1024", "ws_4MiB": "4096"}
# (name, M, N, K, A dtype, fast_accum): Fprop X[M,K] W^T, Dgrad dY[M,N] W, Wgrad dY^T X, for the MLP's up/gate
# (hidden 2048 -> 8192) and down (8192 -> 2048) layers at 8192 tokens
GEMMS = [("fprop_up", 8192, 8192, 2048, "e4m3", True), ("fprop_down", 8192, 2048, 8192, "e4m3", True),
         ("dgrad_up", 8192, 2048, 8192, "e5m2", False), ("dgrad_down", 8192, 8192, 2048, "e5m2", False),
         ("wgrad_up", 8192, 2048, 8192, "e5m2", False), ("wgrad_down", 2048, 8192, 8192, "e5m2", False)]


def child() -> dict:
    import torch

    from bench.kernel_bench import graph_timed
    dev = torch.device("cuda")
    out = {}
    for name, m, n, k, adt, fast in GEMMS:
        a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn if adt == "e4m3" else torch.float8_e5m2)
        b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t()  # column-major second operand
        one = torch.ones((), device=dev)

        def gemm():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)
        gemm()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                gemm()
            torch.cuda.synchronize()
        kernels, memsets = {}, 0
        for e in prof.events():
            if not str(getattr(e, "device_type", "")).endswith("CUDA"):
                continue
            if "memset" in e.name.lower():
                memsets += 1
            else:
                kernels[e.name[:70]] = kernels.get(e.name[:70], 0) + 1
        ms = graph_timed(gemm)
        out[name] = {"ms": ms, "memsets_per_call": memsets / 5, "kernels": sorted(kernels),
                     "tflops": 2 * m * n * k / ms / 1e9}
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child()))
        return 0
    import torch
    results = {}
    for label, ws in SETTINGS.items():
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
        if ws is not None:
            env["CUBLASLT_WORKSPACE_SIZE"] = ws
        proc = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=300)
        line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
        results[label] = json.loads(line) if line else {"error": proc.stderr[-1500:]}
    from bench.benchmeta import git_commit
    out = {"bench": "scaled_mm_memset_probe", "device": torch.cuda.get_device_name(), "git_commit": git_commit(),
           "results": results}
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "scaled_mm_memset_probe.json").write_text(json.dumps(out, indent=1))
    print(f"{'setting':10s} {'gemm':12s} {'ms':>8s} {'TFLOP/s':>8s} {'memsets':>8s}  kernel")
    for label, r in results.items():
        if "error" in r:
            print(label, r["error"][-600:])
            continue
        for name, g in r.items():
            print(f"{label:10s} {name:12s} {g['ms']:8.4f} {g['tflops']:8.0f} {g['memsets_per_call']:8.1f}  "
                  f"{' | '.join(g['kernels'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
