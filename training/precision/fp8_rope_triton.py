"""fp8_delayed's QKV projection, backward: RoPE's backward, the concatenation of dQ, dK and dV and their E5M2 cast in one
pass that writes both FP8 layouts and the amax (GPU fast path of `fp8_delayed`'s fused QKV projection,
fp8_delayed.DelayedQKVRoPEFn).

The fused QKV projection's dY is [dQ | dK | dV] (tokens x (heads + 2 kv_heads) * head_dim), where dQ and dK are the
gradients that reach RoPE's outputs taken back through RoPE. Inductor's compiled step fuses RoPE's backward, the
concatenation, the cast and the row amax into one reduction kernel, with ~13 masked loads and modulo indexing per
element, and stores the row-major codes twice (the second copy is the input of the transposing copy,
fp8_triton.fp8_transpose): 0.127 ms per layer on the 1b shape on one H100, 2.8x its bytes, plus the copy into the
Wgrad layout (`step_profile_2026-11-27T2116_*`). Here one program takes a BM x head_dim tile of one head: the head
is known per program (Q and K heads rotate, V heads are copied), the partner half of each row is a second load of
the same cache lines, and the codes are written once in each layout.

The math is inductor's, operation for operation (torch 2.11, HF's `apply_rotary_pos_emb` under autograd): with
p = dY[d +- D/2] * sin[d +- D/2] (the partner half), rot = where(d >= D/2, -p, 0) + where(d < D/2, p, 0), and
dX = rot + dY * cos, in FP32 from the BF16 inputs without intermediate roundings (the multiply-add contracted as
inductor's is); the codes cast from those FP32 values as formats.fp8_cast. The amax is max |dX| rounded to the
gradient's dtype (the layers' path takes the max of its BF16 operand; rounding is monotonic, so they agree).
`rope_bwd_fp8_reference` is the same computation in torch ops (CPU, no Triton, and the tests' reference).

fp8_tensorwise's fused QKV projection (current scaling, option fused_qkv_rope) runs the kernel twice: first with the
stores compiled out (`rope_bwd_amax`), then with the scale from that amax and `rounded` (the codes of the values
rounded to BF16, as the layer's compiled path casts them under current scaling: bench/NOTES_floor.md 80).
"""
from __future__ import annotations

import torch

from training.precision.formats import fp8_cast
from training.rope_triton import rope_bwd_values, tile_arguments, usable
from training.triton_math import HAVE_TRITON, bf16_partials_amax, compiled_for_gpu

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from training.rope_triton import rope_bwd_tile
    from training.triton_math import bf16_bits_rne, bf16_to_f32, fp8_code_fast

BM, NUM_WARPS = 32, 4  # a program: 32 tokens x one head (the SwiGLU kernel's 32 x 128 tile at head_dim 128)
E5M2 = torch.float8_e5m2

if HAVE_TRITON:
    @triton.jit
    def _rope_bwd_fp8_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, scale_ptr, q_ptr, qt_ptr, partial_ptr,
                             M, C, HQ, HK, stride_dq, stride_dk, stride_dv, stride_cos, COS_ROWS,
                             NATIVE: tl.constexpr, STORE: tl.constexpr, ROUNDED: tl.constexpr, D: tl.constexpr,
                             BM: tl.constexpr):
        pid_m, head = tl.program_id(0), tl.program_id(1)
        v = rope_bwd_tile(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, pid_m, head, M, HQ, HK, stride_dq, stride_dk,
                          stride_dv, stride_cos, COS_ROWS, D, BM)
        tl.store(partial_ptr + pid_m * tl.num_programs(1) + head,
                 bf16_bits_rne(tl.max(tl.max(tl.abs(v), axis=1), axis=0)))
        if STORE:
            if ROUNDED:  # the codes of the BF16-rounded values (the amax is the same either way)
                v = bf16_to_f32(bf16_bits_rne(v))
            rows = pid_m * BM + tl.arange(0, BM)  # the store addresses from this kernel's own indices (rope_bwd_tile)
            d = tl.arange(0, D)
            mask = (rows[:, None] < M) & (d[None, :] < D)
            r = rows[:, None].to(tl.int64)
            code = fp8_code_fast(v * tl.load(scale_ptr), 57344.0, True, NATIVE).to(q_ptr.dtype.element_ty,
                                                                                   bitcast=True)
            cols = head * D + d
            tl.store(q_ptr + r * C + cols[None, :], code, mask=mask)
            tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(code), mask=tl.trans(mask))


def rope_bwd_fp8_launch(dq, dk, dv, cos, sin, scale, *, wrap=lambda kernel: kernel, bm: int = BM,
                        num_warps: int = NUM_WARPS, store: bool = True, rounded: bool = False):
    """Launch the kernel (under the interpreter too): (g8 [N, C], g8t [C, N], amax) as in the module docstring.
    dq [B, T, Hq, D], dk and dv [B, T, Hk, D] BF16; cos, sin [1 or B, T, D] BF16; scale an FP32 device scalar.
    With store False (current scaling's first pass; scale not needed) only the amax. `rounded`: the codes cast from
    the values rounded to BF16 (`rope_bwd_fp8`)."""
    (gq, gk, gv, cos2, sin2), m, c, hq, hk, d = tile_arguments(dq, dk, dv, cos, sin)
    grid = (triton.cdiv(m, bm), hq + 2 * hk)
    partial = torch.empty(grid[0] * grid[1], device=dq.device, dtype=torch.int16)
    if store:
        g8 = torch.empty((m, c), device=dq.device, dtype=E5M2)
        g8t = torch.empty((c, m), device=dq.device, dtype=E5M2)
    else:
        g8 = g8t = scale = partial  # not written (the STORE branch is compiled out)
    wrap(_rope_bwd_fp8_kernel)[grid](gq, gk, gv, cos2, sin2, scale, g8, g8t, partial, m, c, hq, hk, gq.stride(0),
                                     gk.stride(0), gv.stride(0), cos2.stride(0), cos2.shape[0],
                                     NATIVE=compiled_for_gpu(), STORE=store, ROUNDED=rounded, D=d, BM=bm,
                                     num_warps=num_warps)
    return (g8, g8t, bf16_partials_amax(partial)) if store else bf16_partials_amax(partial)


if HAVE_TRITON:
    from torch.library import triton_op, wrap_triton

    @triton_op("plab::rope_bwd_fp8", mutates_args=())
    def _rope_bwd_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     scale: torch.Tensor, rounded: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return rope_bwd_fp8_launch(dq, dk, dv, cos, sin, scale, wrap=wrap_triton, rounded=rounded)

    @triton_op("plab::rope_bwd_amax", mutates_args=())
    def _rope_bwd_amax_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> torch.Tensor:
        return rope_bwd_fp8_launch(dq, dk, dv, cos, sin, None, wrap=wrap_triton, store=False)


def rope_bwd_fp8_reference(dq, dk, dv, cos, sin, scale, rounded: bool = False):
    """The kernel's results in torch ops (any float dtype; the amax rounded to the gradients' dtype; `rounded`: the
    codes cast from the values rounded to it); what runs on a CPU or without Triton."""
    v = rope_bwd_values(dq, dk, dv, cos, sin)
    g8 = fp8_cast(v.to(dq.dtype).to(v.dtype) if rounded else v, scale, E5M2)[0]
    return g8, g8.t().contiguous(), v.abs().amax().to(dq.dtype).to(torch.float32)


def rope_bwd_fp8(dq, dk, dv, cos, sin, scale, rounded: bool = False):
    """(g8, g8t, amax): E5M2 codes of [RoPE⁻¹(dQ) | RoPE⁻¹(dK) | dV] (tokens x features) in both layouts, and the
    amax (see the module docstring). `rounded`: the codes of the values rounded to the gradients' dtype (BF16) first,
    as current scaling's layer path casts them: inductor's amax pass writes dY in BF16 there and the cast, which must
    wait for the amax, reads it back (fp8_delayed's path with the history's scale fuses the cast into the pass that
    forms dY, from the FP32 values: `rounded` False)."""
    if usable(dq, cos):
        return torch.ops.plab.rope_bwd_fp8(dq, dk, dv, cos, sin, scale, rounded)
    return rope_bwd_fp8_reference(dq, dk, dv, cos, sin, scale, rounded)


def rope_bwd_amax(dq, dk, dv, cos, sin):
    """Current scaling's first pass: the amax rope_bwd_fp8 records, from the same kernel with its stores compiled out
    (the torch reference's on a CPU), so the scale taken from it is the one the second pass's own amax would give."""
    if usable(dq, cos):
        return torch.ops.plab.rope_bwd_amax(dq, dk, dv, cos, sin)
    return rope_bwd_values(dq, dk, dv, cos, sin).abs().amax().to(dq.dtype).to(torch.float32)
