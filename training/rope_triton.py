"""RoPE on the fused QKV projection's output, with its backward in one pass (`training.perf.rope_backward`).

The fused QKV projection (model.fuse_qkv) hands the attention [Q | K | V] (tokens x (heads + 2 kv_heads) * head_dim),
and RoPE rotates the Q and K heads. Its backward takes dQ, dK and dV from the attention's backward and forms the
projection's dY = [RoPE⁻¹(dQ) | RoPE⁻¹(dK) | dV]. Inductor compiles that as one flat pointwise kernel with ~13 masked
loads and modulo indexing per element (`triton_poi_fused__unsafe_view_add_cat_clone_mul_neg_slice_slice_backward_...`):
1.29 ms a step on the 1b shape on an H100 (1.35 ms on an H200, 5.4x its bytes in bench/rope_bench.py). Here one
program takes BM tokens of one head: the head is known per program (Q and K heads rotate, V heads are copied), and the
two halves of each row are loaded once each and rotated against each other (`_rope_bwd_halves`). fp8_delayed's FP8
version of this pass (precision/fp8_rope_triton.py) uses this module's whole-row tile (`rope_bwd_tile`), where the
partner half is a second load of the same cache lines.

The math is inductor's, operation for operation (torch 2.11, HF's `apply_rotary_pos_emb` under autograd): with
p = dY[d +- D/2] * sin[d +- D/2] (the partner half), rot = where(d >= D/2, -p, 0) + where(d < D/2, p, 0), and
dX = rot + dY * cos, in FP32 from the BF16 inputs without intermediate roundings, rounded once to BF16 (nearest
even) as inductor stores it. `rope_bwd_reference` is the same computation in torch ops: what runs on a CPU or
without Triton, and the tests' reference.

Where inductor would fuse RoPE's backward into the consumer of dY (an FP8 cast of torchao's Float8Linear or
fp8_delayed's layers), a materialized BF16 dY is an extra round trip and another rounding before the cast; where it
fuses the projection's own epilogue into RoPE's forward (NVFP4's emulated per-tensor scale), the one-pass forward
rounds that product first. `auto` keeps inductor's kernels there (`auto_one_pass`).
"""
from __future__ import annotations

import torch
# The module object, imported here (outside compiled code), as training.model does: Dynamo cannot trace an import
# through transformers' lazy package module.
from transformers.models.llama import modeling_llama as _llama

from training.triton_math import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from training.triton_math import bf16_bits_rne, bf16_to_f32

# A program: 16 tokens x one head, loaded as two halves (each element once). At the 1b shape on an H200 this ran at
# 1.14x its bytes' time, against 1.39x for fp8_rope_triton's 32-token tile with the partner half loaded a second time
# and 5.4x for inductor's kernel (bench/results/rope_bench_*, bench/NOTES_floor.md 75).
BM, NUM_WARPS, HALVES = 16, 2, True

if HAVE_TRITON:
    @triton.jit
    def rope_bwd_tile(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, pid_m, head, M, HQ, HK, stride_dq, stride_dk,
                      stride_dv, stride_cos, COS_ROWS, D: tl.constexpr, BM: tl.constexpr):
        """One BM x D tile of [RoPE⁻¹(dQ) | RoPE⁻¹(dK) | dV] in FP32 (rows pid_m * BM + arange(BM), all D columns of
        `head`). Only the values are returned: the caller computes its store addresses itself, since inductor's
        analysis of which arguments a user kernel writes takes a pointer built from a call's result as derived from
        every argument of that call (and would then copy the RoPE tables in and out of each compiled backward)."""
        rows = pid_m * BM + tl.arange(0, BM)
        d = tl.arange(0, D)
        mask = (rows[:, None] < M) & (d[None, :] < D)
        r = rows[:, None].to(tl.int64)
        if head < HQ:
            src = dq_ptr + r * stride_dq + head * D
        elif head < HQ + HK:
            src = dk_ptr + r * stride_dk + (head - HQ) * D
        else:
            src = dv_ptr + r * stride_dv + (head - HQ - HK) * D
        g = bf16_to_f32(tl.load(src + d[None, :], mask=mask, other=0.0))
        if head < HQ + HK:  # RoPE's backward (Q and K heads)
            partner = (d + D // 2) % D
            t = (rows % COS_ROWS)[:, None].to(tl.int64) * stride_cos
            gp = bf16_to_f32(tl.load(src + partner[None, :], mask=mask, other=0.0))
            sp = bf16_to_f32(tl.load(sin_ptr + t + partner[None, :], mask=mask, other=0.0))
            c = bf16_to_f32(tl.load(cos_ptr + t + d[None, :], mask=mask, other=0.0))
            p = gp * sp
            upper = d[None, :] >= D // 2
            rot = tl.where(upper, -p, 0.0) + tl.where(upper, 0.0, p)
            v = rot + g * c
        else:
            v = g
        return v

    @triton.jit
    def _rope_bwd_halves(src, cos_ptr, sin_ptr, out_ptr, rows, col0, M, C, stride_cos, COS_ROWS, ROTATE: tl.constexpr,
                         D: tl.constexpr):
        """One BM-row tile of one head, as two D/2 halves: each element loaded once (no partner reload). The same
        operations as rope_bwd_tile: rot = where(upper, -p, 0) + where(upper, 0, p), then rot + g * c."""
        h = tl.arange(0, D // 2)
        mask = (rows[:, None] < M) & (h[None, :] < D // 2)
        r = rows[:, None].to(tl.int64)
        lo = bf16_to_f32(tl.load(src + h[None, :], mask=mask, other=0.0))
        hi = bf16_to_f32(tl.load(src + D // 2 + h[None, :], mask=mask, other=0.0))
        if ROTATE:
            t = (rows % COS_ROWS)[:, None].to(tl.int64) * stride_cos
            c_lo = bf16_to_f32(tl.load(cos_ptr + t + h[None, :], mask=mask, other=0.0))
            c_hi = bf16_to_f32(tl.load(cos_ptr + t + D // 2 + h[None, :], mask=mask, other=0.0))
            s_lo = bf16_to_f32(tl.load(sin_ptr + t + h[None, :], mask=mask, other=0.0))
            s_hi = bf16_to_f32(tl.load(sin_ptr + t + D // 2 + h[None, :], mask=mask, other=0.0))
            p_lo = hi * s_hi  # the lower half's partner: the upper half
            p_hi = lo * s_lo
            v_lo = (0.0 + p_lo) + lo * c_lo
            v_hi = (-p_hi + 0.0) + hi * c_hi
        else:
            v_lo, v_hi = lo, hi
        out = out_ptr + r * C + col0
        tl.store(out + h[None, :], bf16_bits_rne(v_lo).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(out + D // 2 + h[None, :], bf16_bits_rne(v_hi).to(tl.bfloat16, bitcast=True), mask=mask)

    @triton.jit
    def _rope_bwd_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, out_ptr, M, C, HQ, HK, stride_dq, stride_dk,
                         stride_dv, stride_cos, COS_ROWS, D: tl.constexpr, BM: tl.constexpr, HALVES: tl.constexpr):
        pid_m, head = tl.program_id(0), tl.program_id(1)
        if HALVES:
            rows = pid_m * BM + tl.arange(0, BM)
            r = rows.to(tl.int64)
            if head < HQ:
                _rope_bwd_halves(dq_ptr + head * D + (r * stride_dq)[:, None], cos_ptr, sin_ptr, out_ptr, rows,
                                 head * D, M, C, stride_cos, COS_ROWS, True, D)
            elif head < HQ + HK:
                _rope_bwd_halves(dk_ptr + (head - HQ) * D + (r * stride_dk)[:, None], cos_ptr, sin_ptr, out_ptr,
                                 rows, head * D, M, C, stride_cos, COS_ROWS, True, D)
            else:
                _rope_bwd_halves(dv_ptr + (head - HQ - HK) * D + (r * stride_dv)[:, None], cos_ptr, sin_ptr, out_ptr,
                                 rows, head * D, M, C, stride_cos, COS_ROWS, False, D)
        else:
            v = rope_bwd_tile(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, pid_m, head, M, HQ, HK, stride_dq, stride_dk,
                              stride_dv, stride_cos, COS_ROWS, D, BM)
            rows = pid_m * BM + tl.arange(0, BM)
            d = tl.arange(0, D)
            mask = (rows[:, None] < M) & (d[None, :] < D)
            cols = head * D + d
            out = bf16_bits_rne(v).to(tl.bfloat16, bitcast=True)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], out, mask=mask)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """[batch, tokens, heads, head_dim] -> [batch * tokens, heads * head_dim] (a view when the last two dims are
    dense, as the attention kernels' gradients are; else a copy)."""
    return t.reshape(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])


def tile_arguments(dq, dk, dv, cos, sin):
    """The kernels' operands and sizes: ((dQ, dK, dV as token rows, cos and sin as [rows, head_dim]), tokens m,
    features c, hq, hk, head_dim)."""
    b, t, hq, d = dq.shape
    hk = dk.shape[2]
    assert dq.dtype == dk.dtype == dv.dtype == cos.dtype == sin.dtype == torch.bfloat16, "BF16 operands"
    gq, gk, gv = as_rows(dq), as_rows(dk), as_rows(dv)
    cos2, sin2 = cos.reshape(-1, d), sin.reshape(-1, d)
    assert cos2.stride() == sin2.stride() and cos2.stride(1) == 1 and gq.stride(1) == gk.stride(1) == gv.stride(1) == 1
    return (gq, gk, gv, cos2, sin2), b * t, (hq + 2 * hk) * d, hq, hk, d


def rope_bwd_launch(dq, dk, dv, cos, sin, *, wrap=lambda kernel: kernel, bm: int = BM, num_warps: int = NUM_WARPS,
                    halves: bool = HALVES):
    """Launch the kernel (under the interpreter too): dY [N, C] in BF16 as in the module docstring. dq [B, T, Hq, D],
    dk and dv [B, T, Hk, D] BF16; cos, sin [1 or B, T, D] BF16."""
    (gq, gk, gv, cos2, sin2), m, c, hq, hk, d = tile_arguments(dq, dk, dv, cos, sin)
    out = torch.empty((m, c), device=dq.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(m, bm), hq + 2 * hk)
    wrap(_rope_bwd_kernel)[grid](gq, gk, gv, cos2, sin2, out, m, c, hq, hk, gq.stride(0), gk.stride(0), gv.stride(0),
                                 cos2.stride(0), cos2.shape[0], D=d, BM=bm, HALVES=halves, num_warps=num_warps)
    return out


if HAVE_TRITON:
    from torch.library import triton_op, wrap_triton

    @triton_op("plab::rope_bwd", mutates_args=())
    def _rope_bwd_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
        return rope_bwd_launch(dq, dk, dv, cos, sin, wrap=wrap_triton)


def rope_backward_reference(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's backward in FP32 as the kernel computes it: g [B, T, H, D], cos and sin [1 or B, T, D]."""
    half = g.shape[-1] // 2
    gf, c, s = g.float(), cos.float().unsqueeze(2), sin.float().unsqueeze(2)
    p = torch.cat([gf[..., half:] * s[..., half:], gf[..., :half] * s[..., :half]], dim=-1)
    upper = torch.arange(g.shape[-1], device=g.device) >= half
    return (torch.where(upper, -p, 0.0) + torch.where(upper, 0.0, p)) + gf * c


def rope_bwd_values(dq, dk, dv, cos, sin) -> torch.Tensor:
    """[RoPE⁻¹(dQ) | RoPE⁻¹(dK) | dV] (tokens x features) in FP32, in torch ops."""
    rows = lambda t: t.reshape(t.shape[0] * t.shape[1], -1)  # noqa: E731
    return torch.cat([rows(rope_backward_reference(dq, cos, sin)), rows(rope_backward_reference(dk, cos, sin)),
                      rows(dv.float())], dim=-1)


def rope_bwd_reference(dq, dk, dv, cos, sin) -> torch.Tensor:
    """The kernel's dY in torch ops, rounded once to the gradients' dtype."""
    return rope_bwd_values(dq, dk, dv, cos, sin).to(dq.dtype)


def usable(dq: torch.Tensor, cos: torch.Tensor) -> bool:
    """The kernel runs: Triton on a GPU, BF16 gradients and tables, a power-of-two head_dim (one tile per head)."""
    d = dq.shape[-1]
    return (HAVE_TRITON and dq.is_cuda and dq.dtype == cos.dtype == torch.bfloat16 and d >= 16
            and d & (d - 1) == 0)


def rope_bwd(dq, dk, dv, cos, sin) -> torch.Tensor:
    """dY = [RoPE⁻¹(dQ) | RoPE⁻¹(dK) | dV] (tokens x features) in the gradients' dtype (see the module docstring)."""
    if usable(dq, cos):
        return torch.ops.plab.rope_bwd(dq, dk, dv, cos, sin)
    return rope_bwd_reference(dq, dk, dv, cos, sin)


class QKVRoPEFn(torch.autograd.Function):
    """HF's `apply_rotary_pos_emb` on the fused QKV projection's output y [batch, tokens, (n_q + 2 n_kv) * head_dim]:
    (q, k, v), each [batch, tokens, heads, head_dim] (v a view of y). Backward forms the projection's dY in one pass
    (`rope_bwd`) instead of RoPE's backward, the slices' and the concatenation's."""

    @staticmethod
    def forward(ctx, y, cos, sin, n_q: int, n_kv: int):
        head_dim = cos.shape[-1]
        q, k, v = y.view(y.shape[0], y.shape[1], n_q + 2 * n_kv, head_dim).split([n_q, n_kv, n_kv], dim=2)
        q, k = _llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        ctx.save_for_backward(cos, sin)
        ctx.y_shape = y.shape
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        return rope_bwd(dq, dk, dv, cos, sin).view(ctx.y_shape), None, None, None, None


def qkv_rope_applies(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> bool:
    """QKVRoPEFn's conditions: y [batch, tokens, features], HF's cos and sin tables [1 or batch, tokens, head_dim] in
    y's dtype (a floating one)."""
    return (y.dim() == 3 and cos.dim() == 3 and cos.shape == sin.shape and cos.shape[0] in (1, y.shape[0])
            and cos.shape[1] == y.shape[1] and cos.shape[2] == head_dim and cos.dtype == sin.dtype == y.dtype
            and y.dtype.is_floating_point)


def split_qkv_rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, split, head_dim: int, one_pass: bool):
    """(q, k, v), each [batch, heads, tokens, head_dim], from the fused QKV projection's output y [batch, tokens,
    features] with `split` = (Q, K, V widths): HF's RoPE on q and k. `one_pass`: through QKVRoPEFn (its backward one
    pass) where its conditions hold (`qkv_rope_applies`); else the split, HF's RoPE and their autograd, left to the
    compiler."""
    if one_pass and qkv_rope_applies(y, cos, sin, head_dim):
        n_q, n_kv = split[0] // head_dim, split[1] // head_dim
        return tuple(t.transpose(1, 2) for t in QKVRoPEFn.apply(y, cos, sin, n_q, n_kv))
    q, k, v = y.split(split, dim=-1)
    q, k, v = (t.reshape(*y.shape[:-1], -1, head_dim).transpose(1, 2) for t in (q, k, v))
    q, k = _llama.apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def auto_one_pass(layer: torch.nn.Module) -> bool:
    """Whether `auto` runs the one-pass backward behind this QKV projection: where the run's values are the compiled
    path's to the bit. Torch's linear (bf16, and BF16 layers kept in a quantized run), and layers that say so with
    `rope_one_pass_auto` (MXFP8's emulated linear: its Triton quantizer reads dY as BF16, and its output reaches RoPE
    as the GEMM wrote it). Not where inductor fuses RoPE's backward into an FP8 cast of dY (torchao's Float8Linear,
    fp8_tensorwise's CurrentScalingLinear, fp8_delayed's layers), nor where it fuses a pointwise epilogue of the
    projection into RoPE's forward (NVFP4's emulated per-tensor scale: the one-pass forward rounds the scaled output
    to BF16 first, and nvfp4's first loss moved from 10.80476 to 10.8028 on an H200, bench/NOTES_floor.md 75). Checked
    again after the first compiled step's graph breaks were gone (bench/NOTES_floor.md 87): on a 2-block NVFP4 model
    one_pass gave the same logits and other gradients (most elements, up to ~6 % of the max: a dY differing in its
    last bits moves FP4 roundings), on the 1b shape another first loss (10.80223 against 10.81155) and -0.4 ms."""
    return type(layer) is torch.nn.Linear or getattr(layer, "rope_one_pass_auto", False)
