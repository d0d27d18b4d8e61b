"""Where a training step's GPU time goes: the reference stack vs our trainer, kernel time by category.

Profiles 3 steps (after warm-up) of
  * `anchor`: the step of ../shared/tools/hf_llama_anchor.py (HF Llama in BF16, torch.compile, fused AdamW,
    labels=x), rebuilt here line for line so it can run under the profiler;
  * `ours:<config>`: training.train.train on the same shape, with the perf/param switches of the config
    (same syntax as bench/train_bench.py, e.g. `bf16`, `bf16:param_dtype=fp32`),
each in its own subprocess, and prints per category (GEMM, attention, optimizer, other elementwise or
reduction kernels, copies/casts, communication) the GPU milliseconds per step, so that a gap between two
stacks can be attributed. Profiled steps run slower than unprofiled ones: compare categories, not totals
with train_bench.

    python bench/step_profile.py anchor bf16 bf16:param_dtype=fp32
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CATEGORIES = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*(mha|attn)|_efficient_attention", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|sm90_xmma|nvjet|cublas|wgmma|matmul|_scaled_mm|splitk", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|lerp|addcmul", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("copy/cast", re.compile(r"memcpy|memset|copy_|to_copy|cast|direct_copy|fill", re.I)),
    ("triton/elementwise", re.compile(r"triton|elementwise|reduce|vectorized|unrolled|softmax|cross_entropy|nll|"
                                      r"log_softmax|embedding|index|scatter|gather", re.I)),
]


def categorize(name: str) -> str:
    for cat, rx in CATEGORIES:
        if rx.search(name):
            return cat
    return "other"


def _profile(step_fn, warmup: int, active: int = 3) -> dict:
    import torch
    for _ in range(warmup):
        step_fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(active):
            step_fn()
        torch.cuda.synchronize()
    return summarize(prof, active)


def summarize(prof, active: int) -> dict:
    """Device time per category and the top kernels, per step, from a finished profiler."""
    by_cat: dict[str, float] = {}
    top = []
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if us <= 0 or evt.key.startswith("ProfilerStep"):
            continue
        # Only kernels and memcpy/memset (device events), not the CPU ops that launched them.
        if getattr(evt, "device_type", None) is not None and str(evt.device_type).endswith("CPU"):
            continue
        cat = categorize(evt.key)
        by_cat[cat] = by_cat.get(cat, 0.0) + us / 1e3 / active
        top.append((us / 1e3 / active, evt.key[:110], cat))
    top.sort(reverse=True)
    return {"ms_per_step": by_cat, "total_ms": sum(by_cat.values()), "top": top[:25]}


def anchor_worker(batch: int, seq: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_fn = torch.compile(model)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")

    def step():
        step_fn(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _profile(step, warmup=4)


def ours_worker(config_text: str, batch: int, seq: int) -> dict:
    """Our train() with a sink that opens the profiler after the warm-up steps' metrics arrive."""
    import torch
    from bench.train_bench import parse_config, run_spec
    from training.sink import MetricSink
    from training.train import train

    config = parse_config(config_text)
    warmup, active = 6, 3
    spec = run_spec(config, steps=warmup + active + 4, batch=batch, seq=seq)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                  schedule=torch.profiler.schedule(wait=warmup, warmup=1, active=active, repeat=1))

    class StepSink(MetricSink):
        def log(self, step, metrics, *, tokens, wall_time):
            pass

        def event(self, kind, **fields):
            pass

    calls = {"n": 0}

    def should_stop():  # called at the start of every step: the profiler's step boundary
        calls["n"] += 1
        prof.step()
        return False
    prof.start()
    train(spec, StepSink(), should_stop=should_stop)
    prof.stop()
    return summarize(prof, active)


def fusion_probe(tokens: int, hidden: int = 2048, inter: int = 8192, q: int = 2048, kv: int = 512) -> dict:
    """ms per fwd+bwd (one layer's worth) of the projections as separate linears vs fused, BF16, compiled."""
    import torch
    from triton.testing import do_bench

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def make(outs):
        return [torch.nn.Linear(hidden, o, bias=False, device="cuda", dtype=torch.bfloat16) for o in outs]

    def bench(mods, combine):
        def f():
            ys = [m(x) for m in mods]
            combine(ys).backward()
        f = torch.compile(f)
        return do_bench(f, warmup=10, rep=60, return_mode="median")

    def qkv_loss(ys):
        return sum(y.float().square().mean() for y in ys) if len(ys) > 1 else sum(
            t.float().square().mean() for t in ys[0].split([q, kv, kv], dim=-1))

    def mlp_loss(ys):
        g, u = (ys[0], ys[1]) if len(ys) > 1 else ys[0].chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u).float().square().mean()
    out = {}
    out["qkv_separate_ms"] = bench(make([q, kv, kv]), qkv_loss)
    out["qkv_fused_ms"] = bench(make([q + 2 * kv]), qkv_loss)
    out["gate_up_separate_ms"] = bench(make([inter, inter]), mlp_loss)
    out["gate_up_fused_ms"] = bench(make([2 * inter]), mlp_loss)
    return out


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="*", help="`anchor` and/or train_bench-style configs of ours")
    ap.add_argument("--fusion-probe", action="store_true",
                    help="also time fwd+bwd of q,k,v / gate,up as separate linears vs one fused linear")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        out = anchor_worker(a.batch, a.seq) if a.worker == "anchor" else ours_worker(a.worker, a.batch, a.seq)
        print(json.dumps(out), flush=True)
        return 0
    results = {}
    if a.fusion_probe:
        results["fusion_probe"] = fusion_probe(a.batch * a.seq)
        for k, v in results["fusion_probe"].items():
            print(f"[fusion] {k}: {v}", flush=True)
    for target in a.targets:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", target, "--batch", str(a.batch),
                                   "--seq", str(a.seq)], capture_output=True, text=True, timeout=a.timeout_s,
                                  cwd=REPO)
            line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
            results[target] = json.loads(line) if line else {"error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            results[target] = {"error": f"timed out after {a.timeout_s} s"}
        results[target]["wall_s"] = time.perf_counter() - t0
        print(f"[profile] {target}: {time.perf_counter() - t0:.0f} s", flush=True)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "step_profile.json").write_text(json.dumps(results, indent=1))
    profiles = {k: v for k, v in results.items() if k != "fusion_probe"}
    for target, r in profiles.items():
        if "top" in r:
            print(f"\n## {target}: top kernels (ms/step)")
            for ms, name, cat in r["top"][:14]:
                print(f"{ms:8.2f}  {cat:18s} {name}")
    cats = sorted({c for r in profiles.values() for c in r.get("ms_per_step", {})})
    print("\n# GPU ms per step by category (profiled)")
    print(f"{'category':20s}" + "".join(f"{t[:22]:>24s}" for t in profiles))
    for c in cats + ["total"]:
        row = [r.get("total_ms") if c == "total" else r.get("ms_per_step", {}).get(c) for r in profiles.values()]
        print(f"{c:20s}" + "".join(f"{x:24.2f}" if x is not None else f"{'-':>24s}" for x in row))
    for target, r in profiles.items():
        if "error" in r:
            print(f"{target}: {r['error'][-600:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
