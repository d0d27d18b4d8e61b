"""The fused QKV projection's dY = [RoPE⁻¹(dQ) | RoPE⁻¹(dK) | dV] alone on a GPU (`training.perf.rope_backward`):
inductor's kernel (the compiled autograd of HF's `apply_rotary_pos_emb` on the split projection output, the
`compiled` path) against training.rope_triton's one pass in several launch configurations, at the 1b step's shape
(batch 4 x 2048, 16 query heads, 8 KV heads, head dim 128), in the same run.

Each variant's backward is timed alone by its kernels' device time under torch.profiler (per call, over 50 calls: the
autograd calls' host time between them is not counted; for the two autograd rows the pass's own kernel is reported,
and the whole call's kernels, the autograd engine's included, beside it), its dY checked against the compiled path's
bit for bit, and its time set against the floor: the bytes it must move (dQ, dK, dV read, dY written; the cos/sin
tables are L2-resident) at this device's copy bandwidth, measured in the call. dQ, dK and dV are laid out as cuDNN's
attention backward writes them ([batch, tokens, heads, head_dim] memory seen as [batch, heads, tokens, head_dim]).

Prints a table last, writes `$OUT/rope_bench.json` and bench/results/rope_bench_<device>_<time>.json.

    python bench/rope_bench.py [--batch 4 --seq 2048 --heads 16 --kv-heads 8 --head-dim 128 --layers 16]
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchmeta import git_commit, write_result  # noqa: E402
from bench.step_profile import _profile, device_ceilings  # noqa: E402

# (BM, num_warps, halves): the default first
CONFIGS = [(16, 2, True), (32, 4, False), (32, 4, True), (16, 4, True), (8, 1, True), (64, 8, True)]


def device_ms(fn, calls: int = 50) -> tuple[float, dict[str, float]]:
    """(kernel device time per call in ms, ms per call of each kernel by name) of `fn` under torch.profiler, after a
    warm-up (step_profile's window: its kernels and no others)."""
    out = _profile(fn, warmup=5, active=calls)
    return out["total_ms"], {name: ms for ms, name, _ in out["top"]}


def main(argv=None) -> int:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from training.model import llama_config
    from training.rope_triton import rope_bwd_launch, split_qkv_rope

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=16, help="layers per step, for the ms-per-step column")
    a = ap.parse_args(argv)
    dev = "cuda"
    b, t, hq, hk, d = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    config = llama_config({"hidden_size": hq * d, "num_attention_heads": hq, "num_key_value_heads": hk,
                           "intermediate_size": 4 * hq * d, "num_hidden_layers": 1}, 32000, t)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, t, 8, device=dev, dtype=torch.bfloat16)
    cos, sin = LlamaRotaryEmbedding(config, device=dev)(x, torch.arange(t, device=dev).unsqueeze(0))
    y = torch.randn(b, t, (hq + 2 * hk) * d, device=dev, dtype=torch.bfloat16, generator=g)
    grads = [torch.randn(b, t, h, d, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
             for h in (hq, hk, hk)]

    split = [hq * d, hk * d, hk * d]
    layers = lambda yy: split_qkv_rope(yy, cos, sin, split, d, False)  # noqa: E731
    one_pass = lambda yy: split_qkv_rope(yy, cos, sin, split, d, True)  # noqa: E731

    bytes_moved = 2 * 2 * b * t * (hq + 2 * hk) * d  # dQ, dK, dV read and dY written, BF16
    ceilings = device_ceilings()
    floor_ms = bytes_moved / (ceilings["copy_gbps"] * 1e6)
    rows, want = [], None
    for name, fn in (("compiled (inductor)", layers), ("one_pass (QKVRoPEFn, default launch)", one_pass)):
        yy = y.clone().requires_grad_()
        out = torch.compile(fn)(yy)
        dy = torch.autograd.grad(out, yy, grads, retain_graph=True)[0]
        want = dy if want is None else want
        ms, kernels = device_ms(lambda out=out, yy=yy: torch.autograd.grad(out, yy, grads, retain_graph=True))
        # the autograd call also launches the engine's own kernels (a gradient fill or copy): the pass is the kernel
        # named after RoPE's backward (inductor's `..._cat_...`) or ours
        pass_ms = sum(v for k, v in kernels.items() if "_cat_" in k or "rope_bwd" in k)
        rows.append({"variant": name, "ms": ms, "pass_ms": pass_ms, "kernels": kernels,
                     "bit_equal": bool(torch.equal(dy, want))})
    dq, dk, dv = (u.transpose(1, 2) for u in grads)  # [batch, tokens, heads, head_dim] views, as QKVRoPEFn sees them
    for bm, warps, halves in CONFIGS:
        got = rope_bwd_launch(dq, dk, dv, cos, sin, bm=bm, num_warps=warps, halves=halves)
        ms, _ = device_ms(lambda bm=bm, warps=warps, halves=halves: rope_bwd_launch(
            dq, dk, dv, cos, sin, bm=bm, num_warps=warps, halves=halves))
        rows.append({"variant": f"kernel BM={bm} warps={warps} {'halves' if halves else 'tile'}", "ms": ms,
                     "bm": bm, "num_warps": warps, "halves": halves,
                     "bit_equal": bool(torch.equal(got.view(b, t, -1), want))})
    for r in rows:
        r.setdefault("pass_ms", r["ms"])
        r["x_floor"] = r["pass_ms"] / floor_ms
        r["ms_per_step"] = r["pass_ms"] * a.layers
    summary = {"bench": "rope_bench", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "git_commit": git_commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "shape": {"batch": b, "seq": t, "heads": hq, "kv_heads": hk, "head_dim": d, "layers": a.layers},
               "ceilings": ceilings, "bytes_per_layer": bytes_moved, "floor_ms_per_layer": floor_ms, "rows": rows}
    write_result(summary, "rope_bench", torch.cuda.get_device_name())
    print(f"\n# dY of the fused QKV projection, {b} x {t} tokens, {hq}+{hk}+{hk} heads of {d}; floor "
          f"{floor_ms * 1e3:.1f} us a layer ({bytes_moved / 1e6:.0f} MB at {ceilings['copy_gbps']:.0f} GB/s)")
    print(f"{'variant':45s} {'us/layer':>9s} {'x floor':>8s} {'ms/step':>8s} {'call us':>8s}  bits")
    for r in rows:
        print(f"{r['variant']:45s} {r['pass_ms'] * 1e3:9.1f} {r['x_floor']:8.2f} {r['ms_per_step']:8.3f} "
              f"{r['ms'] * 1e3:8.1f}  {'equal' if r['bit_equal'] else 'DIFFER'}")
    print("(us/layer: the pass's kernel; call us: every kernel of the call, the autograd engine's included)")
    return 0 if all(r["bit_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
