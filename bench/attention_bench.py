"""The 1b step's attention alone on a GPU: every SDPA backend PyTorch has, forward + backward, at the shape the
training step runs (batch 4 x 2048, 16 query heads, 8 KV heads, head dim 128, causal, BF16), each timed in the
same run and checked against an FP32 math reference.

  * backends: flash, efficient, cudnn (each pinned alone, as `perf.sdpa_backend` pins it in training), and
    what "auto" picks (`torch._fused_sdp_choice`); and FlexAttention (`torch.nn.attention.flex_attention`,
    compiled, with a causal block mask built once outside the timing; native GQA only), the one attention
    PyTorch has besides SDPA's kernels;
  * GQA: `enable_gqa=True` (what transformers passes when there is no mask) and K/V repeated to 16 heads first
    (what it does otherwise; the repeat's copies are timed with it);
  * error: max |difference| of the output and of dQ, dK, dV against the FP32 math kernel on the same inputs,
    next to flash's, so a faster backend that is less accurate shows it;
  * TFLOP/s from the model FLOPs of causal attention (QK^T and PV forward, four products backward, halved
    for the mask) and ms per 1b step (16 layers) against the floor at the BF16 peak measured in the call.

Prints a table last, writes `$OUT/attention_bench.json` and bench/results/attention_bench_<device>_<time>.json.

    python bench/attention_bench.py [--batch 4 --seq 2048 --heads 16 --kv-heads 8 --head-dim 128 --layers 16]
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchmeta import git_commit, write_result  # noqa: E402
from bench.step_profile import device_ceilings  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def _inputs(a, dev, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, device=dev, dtype=dtype, generator=g)
    k = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, device=dev, dtype=dtype, generator=g)
    v = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, device=dev, dtype=dtype, generator=g)
    dout = torch.randn(a.batch, a.heads, a.seq, a.head_dim, device=dev, dtype=dtype, generator=g)
    return q, k, v, dout


def _fwd_bwd(q, k, v, dout, gqa: str):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if gqa == "native":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        rep = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             is_causal=True)
    out.backward(dout)
    return out, q.grad, k.grad, v.grad


def flex_fwd_bwd(compiled: bool = True, backward: bool = True):
    """FlexAttention's forward + backward in `_fwd_bwd`'s form (causal, native GQA): compiled as training would
    run it (eager flex_attention is a reference implementation); the block mask built once per shape. `backward`
    False: the forward only, gradients None (flex has no backward on a CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    masks = {}

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def fwd_bwd(q, k, v, dout, gqa: str = "native"):
        assert gqa == "native", "flex: native GQA only"
        key = (q.shape[-2], k.shape[-2], q.device)
        if key not in masks:
            masks[key] = create_block_mask(causal, None, None, q.shape[-2], k.shape[-2], device=q.device)
        q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
        out = attend(q, k, v, block_mask=masks[key], enable_gqa=True)
        if backward:
            out.backward(dout)
        return out, q.grad, k.grad, v.grad

    return fwd_bwd


def _timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _auto_choice(q, k, v) -> str:
    try:
        idx = torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=True)
        return SDPBackend(idx).name
    except Exception as e:  # private API: report, never fail the bench on it
        return f"unknown ({type(e).__name__})"


def run(a) -> dict:
    dev = torch.device("cuda")
    ceilings = device_ceilings()
    q, k, v, dout = _inputs(a, dev)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = _fwd_bwd(*(t.float() for t in (q, k, v, dout)), gqa="repeat")
    # model FLOPs: forward QK^T + PV, backward four products; causal halves them
    flop = 6 * 2 * a.batch * a.heads * a.seq * a.seq * a.head_dim / 2
    floor_ms = flop / (ceilings["bf16_tflops"] * 1e12) * 1e3
    rows = []

    def measured(row: dict, got, ms: float) -> dict:
        row["errors_vs_fp32_math"] = {n: (g.float() - r).abs().max().item()
                                     for n, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
        row.update(ms_per_layer=ms, ms_per_step=ms * a.layers, tflops=flop / ms / 1e9, x_floor=ms / floor_ms)
        return row

    for name, backend in BACKENDS.items():
        for gqa in ("native", "repeat"):
            row = {"backend": name, "gqa": gqa}
            try:
                with sdpa_kernel([backend]):
                    got = _fwd_bwd(q, k, v, dout, gqa)
                    ms = _timed(lambda: _fwd_bwd(q, k, v, dout, gqa), a.reps)
            except RuntimeError as e:
                row["error"] = str(e).splitlines()[0][:200]
                rows.append(row)
                continue
            rows.append(measured(row, got, ms))
    row = {"backend": "flex", "gqa": "native"}
    try:
        flex = flex_fwd_bwd()
        got = flex(q, k, v, dout)  # compiles forward and backward
        measured(row, got, _timed(lambda: flex(q, k, v, dout), a.reps))
    except Exception as e:  # noqa: BLE001 - a compile failure is a result of this row, not of the bench
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    rows.append(row)
    return {"bench": "attention_bench", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "git_commit": git_commit(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(),
            "shape": {k: getattr(a, k) for k in ("batch", "seq", "heads", "kv_heads", "head_dim", "layers")},
            "auto_choice": _auto_choice(q, k, v), "ceilings": ceilings,
            "floor_ms_per_layer": floor_ms, "flop_per_layer": flop, "rows": rows}


def print_table(out: dict) -> None:
    print(f"\n{out['device']}, torch {out['torch']}, cuDNN {out['cudnn']}; auto picks {out['auto_choice']}; "
          f"floor {out['floor_ms_per_layer']:.3f} ms per layer at {out['ceilings']['bf16_tflops']:.0f} TFLOP/s")
    print(f"{'backend':10s} {'gqa':7s} {'ms/layer':>9s} {'ms/step':>8s} {'TFLOP/s':>8s} {'x floor':>8s} "
          f"{'max err out/dq/dk/dv':>30s}")
    for r in out["rows"]:
        if "error" in r:
            print(f"{r['backend']:10s} {r['gqa']:7s} cannot run: {r['error']}")
            continue
        e = r["errors_vs_fp32_math"]
        print(f"{r['backend']:10s} {r['gqa']:7s} {r['ms_per_layer']:9.3f} {r['ms_per_step']:8.2f} "
              f"{r['tflops']:8.0f} {r['x_floor']:8.2f} "
              f"{e['out']:7.4f}/{e['dq']:.4f}/{e['dk']:.4f}/{e['dv']:.4f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("batch", 4), ("seq", 2048), ("heads", 16), ("kv-heads", 8), ("head-dim", 128),
                          ("layers", 16), ("reps", 20)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args(argv)
    if a.heads % a.kv_heads:
        ap.error(f"--heads {a.heads} must be a multiple of --kv-heads {a.kv_heads}")
    if not torch.cuda.is_available():
        print("attention_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    out = run(a)
    write_result(out, "attention_bench", out["device"])
    print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
