"""Can MasterAdamW's update run *beside* the next forward's matrix products instead of between them?

train_bench's diagnostics (`bf16:bench.update=skip`, `..._update_share_*`) showed the overlapped update on the
critical path: the BF16 step is 10.4 ms shorter without it. cuBLAS's persistent GEMM kernels take every SM, so the
update's programs, queued on the side stream, run in the gaps between GEMMs rather than beside them. This probe
times a forward-like sequence (the 1b model's 16 layers of QKV, output, gate/up and down products at 4 x 2048
tokens, SiLU x up between, each layer waiting for its bucket's update as the overlapped step does) with:
  * `gemm`: the products alone; `update`: MasterAdamW's Triton update over the 1b model's buckets alone;
  * `both`: the update on a side stream, one program per block (today's step);
  * `both` with an SM carve-out C (`torch._C._set_sm_carveout_experimental`: cuBLAS targets 132 - C SMs) and the
    update's grid cut to C programs that loop over the blocks (`MasterAdamW.update_programs`), so the two share
    the GPU by SMs; and `gemm` alone with the carve-out (what the products lose).
Prints a table last, writes `$OUT/carveout_probe.json` and `bench/results/carveout_probe_<date>_<gpu>.json`.

    python bench/carveout_probe.py [--carveouts 8 16 24 32] [--reps 5] [--blas cublaslt]
        [--update-shapes 8x2048 16x4096]    # the update's warps x elements per program (default 8 x 2048)
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchmeta import git_commit  # noqa: E402
from bench.kernel_bench import HIDDEN, INTER, LAYERS, QKV, TOKENS, _groups, model_buckets, timed  # noqa: E402


def forward_weights(dev):
    def w(*shape):
        return (torch.randn(shape, device=dev) * 0.02).bfloat16()
    return [(w(QKV, HIDDEN), w(HIDDEN, HIDDEN), w(2 * INTER, HIDDEN), w(HIDDEN, INTER)) for _ in range(LAYERS)]


def layer(x, weights):
    wqkv, wo, wgu, wd = weights
    qkv = x @ wqkv.t()
    o = qkv[:, :HIDDEN] @ wo.t()
    gu = (x + o) @ wgu.t()
    a = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
    return x + a @ wd.t()


def run(mode: str, x, weights, opt, buckets, side, events, reps: int) -> float:
    """Median ms of `reps` iterations (after 3 warm-ups, `kernel_bench.timed`) of: the update bucket by bucket on
    `side`, each layer of the forward waiting for its bucket (bucket 0 the embedding, bucket i + 1 layer i) on the
    current stream."""
    main = torch.cuda.current_stream()

    def once():
        if mode in ("update", "both"):
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for i, b in enumerate(buckets):
                    opt.step_params(b)
                    events[i].record(side)
        if mode in ("gemm", "both"):
            h = x
            for i in range(LAYERS):
                if mode == "both":
                    main.wait_event(events[i + 1])
                h = layer(h, weights[i])
        main.wait_stream(side)

    return timed(once, reps)


def main(argv=None) -> int:
    from training.optim import MasterAdamW

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--carveouts", type=int, nargs="*", default=[8, 16, 24, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                    help="torch.backends.cuda.preferred_blas_library (the carve-out is a cuBLASLt attribute)")
    ap.add_argument("--update-shapes", nargs="*", default=["8x2048"],
                    help="the update kernel's WARPSxBLOCK per program, each timed with every carve-out")
    a = ap.parse_args(argv)
    from training import optim_kernels
    if a.blas != "default":
        torch.backends.cuda.preferred_blas_library(a.blas)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    buckets = model_buckets(dev)
    params = [q for b in buckets for q in b]
    for q in params:
        q.grad = (torch.randn_like(q, dtype=torch.float32) * 1e-3).bfloat16()
    opt = MasterAdamW(_groups(params), lr=1e-4, betas=(0.9, 0.95), update="triton")
    opt.grad_scale = torch.tensor(1.3, device=dev)
    weights = forward_weights(dev)
    x = torch.randn(TOKENS, HIDDEN, device=dev).bfloat16()
    side = torch.cuda.Stream(device=dev)
    events = [torch.cuda.Event() for _ in buckets]
    rows = []

    default_tile = optim_kernels.NUM_WARPS, optim_kernels.BLOCK
    default_shape = shape = "x".join(str(v) for v in default_tile)

    def measure(mode, carve, programs):
        torch._C._set_sm_carveout_experimental(carve)
        opt.update_programs = programs
        ms = run(mode, x, weights, opt, buckets, side, events, a.reps)
        torch._C._set_sm_carveout_experimental(None)
        rows.append({"mode": mode, "carveout": carve, "programs": programs, "update_shape": shape, "ms": ms})
        if mode == "update":
            rows[-1]["update_gbps"] = 28 * sum(q.numel() for q in params) / ms / 1e6
            if programs:
                rows[-1]["gbps_per_program"] = rows[-1]["update_gbps"] / programs
        print(f"[probe] {rows[-1]}", flush=True)

    measure("gemm", None, None)
    measure("update", None, None)
    measure("both", None, None)
    for c in a.carveouts:
        measure("gemm", c, None)
    for shape in a.update_shapes:
        warps, block = (int(v) for v in shape.split("x"))
        optim_kernels.NUM_WARPS, optim_kernels.BLOCK = warps, block
        for c in a.carveouts:
            measure("update", None, c)
            measure("both", c, c)
    optim_kernels.NUM_WARPS, optim_kernels.BLOCK = default_tile
    shape = default_shape
    measure("both", None, None)
    out = {"bench": "carveout_probe", "device": torch.cuda.get_device_name(dev), "sms": sms, "blas": a.blas,
           "torch": torch.__version__, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "git_commit": git_commit(), "rows": rows}
    text = json.dumps(out, indent=1)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "carveout_probe.json").write_text(text)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%M")
    gpu = "".join(ch if ch.isalnum() else "_" for ch in out["device"])[:40]
    (REPO / "bench" / "results" / f"carveout_probe_{stamp}_{gpu}.json").write_text(text)
    print(f"\n# carveout_probe on {out['device']} ({sms} SMs), 1b forward products vs MasterAdamW's update")
    base = {r["mode"]: r["ms"] for r in rows if r["carveout"] is None and r["programs"] is None}
    print(f"gemm alone {base['gemm']:.2f} ms, update alone {base['update']:.2f} ms, sum "
          f"{base['gemm'] + base['update']:.2f} ms, both today {base['both']:.2f} ms")
    print(f"{'update':>8s} {'carve-out':>9s} {'gemm alone':>11s} {'update alone':>13s} {'GB/s/SM':>8s} {'both':>8s} "
          f"{'vs today':>9s}")
    for shape in a.update_shapes:
        for c in a.carveouts:
            g = next(x["ms"] for x in rows if x["mode"] == "gemm" and x["carveout"] == c)
            u = next(x for x in rows if x["mode"] == "update" and x["programs"] == c and x["update_shape"] == shape)
            b = next(x["ms"] for x in rows if x["mode"] == "both" and x["programs"] == c and x["update_shape"] == shape)
            print(f"{shape:>8s} {c:9d} {g:11.2f} {u['ms']:13.2f} {u['gbps_per_program']:8.1f} {b:8.2f} "
                  f"{b / base['both']:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
