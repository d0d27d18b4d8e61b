"""Why inductor stores FP8 codes twice when they feed both a `_scaled_mm` and `fp8_transpose`, and what avoids it.

In fp8_delayed's compiled step (torch 2.11) every cast whose codes feed a `_scaled_mm` and the transposing copy
(`plab::fp8_transpose`, a `torch.library.triton_op`) stores the same codes to two buffers (bench/NOTES_floor.md 57):
12 kernels, ~1.9 GB of extra writes a step. Section 57 ruled out inductor's layout constraint for user kernels, and
torch did not log a failed mutation analysis (which would make it clone every input). This compiles one such cast
(BF16 [8192, 2048] * scale -> E4M3) with each consumer pattern below on its own, counts the FP8 stores in the
generated Triton code, and times each compiled function on the GPU:

- `mm_and_triton_op` (and `triton_op_then_mm`, the calls the other way round): the step's pattern;
- `mm_only`, `triton_op_only`: one consumer each (the codes also returned, as the step saves them);
- `two_mms_and_triton_op`: the MLP's gate and up GEMMs and the transpose; `..._on_clone`: the transpose of a clone;
- `mm_and_custom_op`, `*_flexible_custom_op*`: the same transpose kernel behind an opaque `torch.library.custom_op`
  (inductor calls it as an extern kernel), without and with the `flexible_layout` tag;
- the step's pattern under inductor settings: ATEN-only GEMMs, no comprehensive padding, and user kernels with a
  flexible layout constraint.

At 5c5d41f on an H100 every pattern with two consumers stored twice (three with three) except under the flexible
constraint, which did not carry over to the whole step (bench/NOTES_floor.md 59 has the mechanism).

    python bench/transpose_store_probe.py      # one GPU; JSON to $OUT (or bench/results) and a table
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

M, N, K_OUT = 8192, 2048, 4096  # the qkv projection's X [tokens, hidden] and its output width


def fp8_stores(codes: list[str]) -> dict:
    """Per generated Triton kernel that casts to FP8: how many stores write an FP8 cast's value."""
    out = {}
    for src in codes:
        for m in re.finditer(r"def (triton_\w+)\((.*?)(?=\n@triton|\n''', device_str|\Z)", src, re.S):
            body = m.group(0)
            casts = set(re.findall(r"(tmp\d+) = tmp\d+\.to\(tl\.float8\w*\)", body))
            if not casts:
                continue
            stored = re.findall(r"tl\.store\(\w+ \+ \(.*?\), (tmp\d+)", body)
            out[m.group(1)] = sum(1 for v in stored if v in casts)
    return out


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    from bench.benchmeta import git_commit, write_result
    from training.precision.fp8_triton import byte_transpose_launch, fp8_transpose

    @torch.library.custom_op("plab_probe::fp8_transpose_opaque", mutates_args=())
    def transpose_opaque(x: torch.Tensor) -> torch.Tensor:
        return byte_transpose_launch(x)

    @transpose_opaque.register_fake
    def _(x):
        return x.new_empty((x.shape[1], x.shape[0]))

    @torch.library.custom_op("plab_probe::fp8_transpose_flexible", mutates_args=(), tags=(torch.Tag.flexible_layout,))
    def transpose_flexible(x: torch.Tensor) -> torch.Tensor:
        return byte_transpose_launch(x.contiguous())

    @transpose_flexible.register_fake
    def _(x):
        return x.new_empty((x.shape[1], x.shape[0]))

    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    w8t = torch.randn(K_OUT, N, device=dev).to(torch.float8_e4m3fn).t()
    scale = torch.full((), 64.0, device=dev)
    inv = scale.reciprocal()

    def cast(x, scale):
        return (x.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    def mm(q, inv):
        return torch._scaled_mm(q, w8t, scale_a=inv, scale_b=inv, out_dtype=torch.bfloat16, use_fast_accum=True)

    variants = {  # q written once in the source and shared, as fp8_delayed does
        "mm_and_triton_op": lambda x, s, i: (lambda q: (mm(q, i), fp8_transpose(q)))(cast(x, s)),
        "mm_only": lambda x, s, i: (lambda q: (mm(q, i), q))(cast(x, s)),
        "triton_op_only": lambda x, s, i: (lambda q: (q, fp8_transpose(q)))(cast(x, s)),
        "triton_op_then_mm": lambda x, s, i: (lambda q: (lambda qt: (mm(q, i), qt))(fp8_transpose(q)))(cast(x, s)),
        "two_mms_and_triton_op": lambda x, s, i: (lambda q: (mm(q, i), fp8_transpose(q), mm(q, i)))(cast(x, s)),
        "mm_and_triton_op_on_clone": lambda x, s, i: (lambda q: (mm(q, i), fp8_transpose(q.clone())))(cast(x, s)),
        "flexible_custom_op_then_mm": lambda x, s, i: (lambda q: (lambda qt: (mm(q, i), qt))(transpose_flexible(q)))(
            cast(x, s)),
        "mm_then_flexible_custom_op": lambda x, s, i: (lambda q: (mm(q, i), transpose_flexible(q)))(cast(x, s)),
        "mm_and_custom_op": lambda x, s, i: (lambda q: (mm(q, i), transpose_opaque(q)))(cast(x, s)),
    }
    from torch._inductor.utils import run_and_get_code

    import torch._inductor.config as inductor_config
    settings = {"": {}, "+aten_gemm_only": {"max_autotune_gemm_backends": "ATEN"},
                "+no_comprehensive_padding": {"comprehensive_padding": False}}
    flexible = {"triton_kernel_default_layout_constraint": "flexible_layout"}
    runs = [(name, fn, {}) for name, fn in variants.items()]
    runs += [("mm_and_triton_op" + tag, variants["mm_and_triton_op"], cfg) for tag, cfg in settings.items() if cfg]
    runs += [("triton_op_then_mm+flexible_user_kernels", variants["triton_op_then_mm"], flexible),
             ("mm_and_triton_op+flexible_user_kernels", variants["mm_and_triton_op"], flexible)]
    results = {}
    eager = None
    for name, fn, cfg in runs:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True)
        with inductor_config.patch(cfg):
            out, codes = run_and_get_code(compiled, x, scale, inv)
        if name == "mm_and_triton_op":
            calls = [ln.strip() for src in codes for ln in src.splitlines()
                     if re.search(r"_scaled_mm|transpose|\.run\(|empty_strided", ln) and "def " not in ln]
            print("\n".join(calls[-12:]))
        if eager is None:
            eager = [t.float() if t.dtype.itemsize > 1 else t.view(torch.uint8) for t in fn(x, scale, inv)]
        for _ in range(5):
            compiled(x, scale, inv)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(100):
            compiled(x, scale, inv)
        end.record()
        torch.cuda.synchronize()
        stores = fp8_stores(codes)
        results[name] = {"fp8_stores_per_kernel": stores, "fp8_stores": sum(stores.values()),
                         "ms_per_call": start.elapsed_time(end) / 100,
                         "transposed_equal": (bool(torch.equal(out[1].view(torch.uint8), eager[1]))
                                              if tuple(out[1].shape) == (N, M) else None),
                         "inductor_config": cfg,
                         "gemm_equal": (bool(torch.equal(out[0].float(), eager[0]))
                                        if out[0].dtype == torch.bfloat16 else None)}
    import datetime as dt
    doc = {"bench": "transpose_store_probe", "git_commit": git_commit(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "shape": {"M": M, "N": N, "gemm_out": K_OUT}, "variants": results}
    write_result(doc, "transpose_store_probe", torch.cuda.get_device_name())
    print(f"{'variant':20s} {'fp8 stores':>10s} {'ms/call':>8s}  kernels")
    for name, r in results.items():
        print(f"{name:20s} {r['fp8_stores']:>10d} {r['ms_per_call']:8.4f}  {r['fp8_stores_per_kernel']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
