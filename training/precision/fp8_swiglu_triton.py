"""fp8_delayed's SwiGLU in one pass per direction: the activation (or its backward) computed from the BF16 GEMM
outputs, its FP8 codes written in both layouts the next GEMMs read, its amax recorded (GPU fast path of
`fp8_delayed`'s fused MLP, fp8_delayed.DelayedSwiGLUMLPFn).

Forward: h = silu(g) * u from the gate and up outputs, cast to E4M3 with the down projection's input scale: the
row-major codes (down's Fprop) and the transposed ones (down's Wgrad), and max |h|. Backward: from g, u and
dL/dh (down's Dgrad output), dL/dg = silu'(g) * u * dL/dh and dL/du = silu(g) * dL/dh, each cast to E5M2 with
its layer's gradient scale in both layouts (gate's and up's Dgrad and Wgrad), and their amaxes. Inductor's
compiled step fuses the same math with the row-major cast and records the amax in that pass, but writes the
transposed layout from a second kernel that re-reads the codes (fp8_triton.fp8_transpose): here one tile is
read once and written twice. The codes come from the GPU's conversion instruction (triton_math.fp8_code_fast; the
bit arithmetic of fp8_code under Triton's interpreter). On the 1b shape (8192 tokens x 8192) on one H100, alone
(bench/swiglu_cast_probe.py, GPU time from CUDA graphs): backward 0.276 ms, forward 0.151 ms (1.23x and 1.13x their
bytes), where inductor's kernels took 0.276 and 0.158 ms in the step plus ~0.17 and ~0.09 ms of transposing copies;
in the whole step 90.4 against 92.1 ms with the bit arithmetic (bench/NOTES_floor.md 51), 87.8 against 89.1 ms with
the conversion instruction and the one-pass weights (54).

The math is inductor's, operation for operation (torch 2.11; the generated kernel is recorded by the probe):
silu(g) = g / (exp(-g) + 1); silu's backward (aten.silu_backward's decomposition) ((dh * u) * s) * (g * (1 - s)
+ 1) with s = 1 / (exp(-g) + 1), all in FP32 from the BF16 inputs without intermediate roundings, and the codes
cast from those FP32 values as formats.fp8_cast (clamp, round to nearest even). The amax the layer records is the
max over its BF16 operand, i.e. max |v| rounded to BF16 (rounding is monotonic, so that is the BF16 tensor's max).
`swiglu_fp8_reference` is the same computation in torch ops (CPU, no Triton, and the tests' reference).

fp8_tensorwise's fused MLP (current scaling, option fused_swiglu) needs each amax before its cast: it runs the kernel
twice, first with the stores compiled out (`swiglu_amax`: the amaxes only, reading g, u and dh once more), then with
the scales from those amaxes. On the 1b shape on an H200 the two passes took 9.05 ms a step against the one pass's
5.63 ms under fp8_delayed's history (bench/NOTES_floor.md 80).
"""
from __future__ import annotations

import torch

from training.precision.formats import fp8_cast
from training.triton_math import HAVE_TRITON, bf16_partials_amax, compiled_for_gpu

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from training.triton_math import bf16_bits_rne, bf16_to_f32, fp8_code_fast

# Tile of one program: 32 rows x 128 columns, 4 warps (swiglu_cast_probe on an H100, 8192 x 8192, both layouts, GPU time
# from CUDA graphs, with the hardware FP8 conversion: backward 0.276 ms, 1.23x its bytes' floor; 32 x 64: 1.27x,
# 64 x 64: 1.26x, 16 x 128: 1.69x, 32 x 256 with 8 warps: 1.25x; forward 0.151 ms, 1.13x. With fp8_code's bit
# arithmetic 32 x 64 had been the best, at 1.63x).
BM, BN, NUM_WARPS = 32, 128, 4
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

if HAVE_TRITON:
    @triton.jit
    def _silu_parts(g, LIBDEVICE: tl.constexpr):
        # libdevice's expf, as inductor's kernels (tl.exp compiles to the approximate ex2); Triton's CPU interpreter
        # has no libdevice, and its tl.exp is numpy's.
        if LIBDEVICE:
            e = libdevice.exp(-g) + 1.0
        else:
            e = tl.exp(-g) + 1.0
        return g / e, 1.0 / e  # silu(g), sigmoid(g)

    @triton.jit
    def _store_both(code, q_ptr, qt_ptr, rows, cols, mask, M, N):
        r = rows[:, None].to(tl.int64)
        c = cols[:, None].to(tl.int64)
        tl.store(q_ptr + r * N + cols[None, :], code, mask=mask)
        tl.store(qt_ptr + c * M + rows[None, :], tl.trans(code), mask=tl.trans(mask))

    @triton.jit
    def _swiglu_fp8_kernel(g_ptr, u_ptr, dh_ptr, sa_ptr, sb_ptr, qa_ptr, qat_ptr, qb_ptr, qbt_ptr, partial_ptr,
                           M, N, stride_g, stride_u, stride_dh, BACKWARD: tl.constexpr, FP8_MAX: tl.constexpr,
                           E5M2: tl.constexpr, LIBDEVICE: tl.constexpr, STORE: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        r = rows[:, None].to(tl.int64)
        g = bf16_to_f32(tl.load(g_ptr + r * stride_g + cols[None, :], mask=mask, other=0.0))
        u = bf16_to_f32(tl.load(u_ptr + r * stride_u + cols[None, :], mask=mask, other=0.0))
        silu, sig = _silu_parts(g, LIBDEVICE)
        pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if BACKWARD:
            dh = bf16_to_f32(tl.load(dh_ptr + r * stride_dh + cols[None, :], mask=mask, other=0.0))
            a = ((dh * u) * sig) * (g * (1.0 - sig) + 1.0)  # dL/dg
            b = dh * silu  # dL/du
            tl.store(partial_ptr + 2 * pid + 1, bf16_bits_rne(tl.max(tl.max(tl.abs(b), axis=1), axis=0)))
            if STORE:
                code_b = fp8_code_fast(b * tl.load(sb_ptr), FP8_MAX, E5M2, LIBDEVICE)
                code_b = code_b.to(qb_ptr.dtype.element_ty, bitcast=True)
                _store_both(code_b, qb_ptr, qbt_ptr, rows, cols, mask, M, N)
            tl.store(partial_ptr + 2 * pid, bf16_bits_rne(tl.max(tl.max(tl.abs(a), axis=1), axis=0)))
        else:
            a = silu * u  # h
            tl.store(partial_ptr + pid, bf16_bits_rne(tl.max(tl.max(tl.abs(a), axis=1), axis=0)))
        if STORE:
            code_a = fp8_code_fast(a * tl.load(sa_ptr), FP8_MAX, E5M2, LIBDEVICE)
            code_a = code_a.to(qa_ptr.dtype.element_ty, bitcast=True)
            _store_both(code_a, qa_ptr, qat_ptr, rows, cols, mask, M, N)


def swiglu_fp8_launch(g, u, dh, scale_a, scale_b, *, wrap=lambda kernel: kernel, bm: int = BM, bn: int = BN,
                      num_warps: int = NUM_WARPS, store: bool = True):
    """Launch the kernel (under the interpreter too). Forward (dh None): (h8, h8t, amax_h), E4M3 with scale_a.
    Backward: (dg8, dg8t, amax_dg, du8, du8t, amax_du), E5M2 with scale_a (gate) and scale_b (up). With store False
    (current scaling's first pass, scales not needed) only the amaxes: amax_h, or (amax_dg, amax_du)."""
    m, n = g.shape
    backward = dh is not None
    assert g.dtype == u.dtype == torch.bfloat16 and (dh is None or dh.dtype == torch.bfloat16), "BF16 operands"
    assert g.stride(1) == u.stride(1) == 1 and (dh is None or dh.stride(1) == 1), "unit column stride"
    dtype = E5M2 if backward else E4M3
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    partial = torch.empty(grid[0] * grid[1] * (2 if backward else 1), device=g.device, dtype=torch.int16)
    if store:
        qa, qat = (torch.empty((m, n), device=g.device, dtype=dtype),
                   torch.empty((n, m), device=g.device, dtype=dtype))
        qb, qbt = ((torch.empty((m, n), device=g.device, dtype=dtype),
                    torch.empty((n, m), device=g.device, dtype=dtype)) if backward else (qa, qat))
    else:
        qa = qat = qb = qbt = partial  # not written (the STORE branches are compiled out)
        scale_a = scale_b = partial
    wrap(_swiglu_fp8_kernel)[grid](g, u, dh if backward else g, scale_a, scale_b if backward else scale_a, qa, qat,
                                   qb, qbt, partial, m, n, g.stride(0), u.stride(0),
                                   dh.stride(0) if backward else 0, BACKWARD=backward,
                                   FP8_MAX=57344.0 if backward else 448.0, E5M2=backward,
                                   LIBDEVICE=compiled_for_gpu(), STORE=store, BM=bm, BN=bn,
                                   num_warps=num_warps)
    if not backward:
        amax = bf16_partials_amax(partial)
        return (qa, qat, amax) if store else amax
    pairs = partial.view(-1, 2)
    amax_a, amax_b = bf16_partials_amax(pairs[:, 0]), bf16_partials_amax(pairs[:, 1])
    return (qa, qat, amax_a, qb, qbt, amax_b) if store else (amax_a, amax_b)


if HAVE_TRITON:
    from torch.library import triton_op, wrap_triton

    @triton_op("plab::swiglu_fp8_fwd", mutates_args=())
    def _fwd_op(g: torch.Tensor, u: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
        return swiglu_fp8_launch(g, u, None, scale, None, wrap=wrap_triton)

    @triton_op("plab::swiglu_fp8_bwd", mutates_args=())
    def _bwd_op(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, scale_g: torch.Tensor,
                scale_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor, torch.Tensor]:
        return swiglu_fp8_launch(g, u, dh, scale_g, scale_u, wrap=wrap_triton)

    @triton_op("plab::swiglu_amax_fwd", mutates_args=())
    def _amax_fwd_op(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return swiglu_fp8_launch(g, u, None, None, None, wrap=wrap_triton, store=False)

    @triton_op("plab::swiglu_amax_bwd", mutates_args=())
    def _amax_bwd_op(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return swiglu_fp8_launch(g, u, dh, None, None, wrap=wrap_triton, store=False)


def _swiglu_values(g, u, dh=None):
    """The FP32 values the kernel casts: h = silu(g) * u, or (dL/dg, dL/du) with dh (the module docstring's math)."""
    gf, uf = g.float(), u.float()
    e = torch.exp(-gf) + 1.0
    silu, sig = gf / e, 1.0 / e
    if dh is None:
        return silu * uf
    dhf = dh.float()
    return ((dhf * uf) * sig) * (gf * (1.0 - sig) + 1.0), dhf * silu


def _amax_of(v, dtype):
    return v.abs().amax().to(dtype).to(torch.float32)


def swiglu_fp8_reference(g, u, dh=None, scale_a=None, scale_b=None):
    """The kernel's results in torch ops (FP32 math from the inputs, as the kernel; the amax the max of an operand in
    the inputs' dtype); same return values. Also what runs on a CPU or without Triton (BF16 or FP32 inputs)."""

    def cast(v, scale, dtype):
        q = fp8_cast(v, scale, dtype)[0]
        return q, q.t().contiguous(), _amax_of(v, g.dtype)

    if dh is None:
        return cast(_swiglu_values(g, u), scale_a, E4M3)
    a, b = _swiglu_values(g, u, dh)
    return (*cast(a, scale_a, E5M2), *cast(b, scale_b, E5M2))


def swiglu_amax_reference(g, u, dh=None):
    """The amax-only pass in torch ops: max |h|, or (max |dL/dg|, max |dL/du|), each rounded to the inputs' dtype."""
    if dh is None:
        return _amax_of(_swiglu_values(g, u), g.dtype)
    return tuple(_amax_of(v, g.dtype) for v in _swiglu_values(g, u, dh))


def usable(t: torch.Tensor) -> bool:
    return HAVE_TRITON and t.is_cuda


def swiglu_fp8_fwd(g, u, scale):
    """(h8, h8t, amax_h): E4M3 codes of silu(g) * u in both layouts, and max |h| (see the module docstring)."""
    if usable(g):
        return torch.ops.plab.swiglu_fp8_fwd(g, u, scale)
    return swiglu_fp8_reference(g, u, None, scale)


def swiglu_fp8_bwd(g, u, dh, scale_g, scale_u):
    """(dg8, dg8t, amax_dg, du8, du8t, amax_du): E5M2 codes of the SwiGLU backward in both layouts, and amaxes."""
    if usable(g):
        return torch.ops.plab.swiglu_fp8_bwd(g, u, dh, scale_g, scale_u)
    return swiglu_fp8_reference(g, u, dh, scale_g, scale_u)


def swiglu_amax(g, u, dh=None):
    """Current scaling's first pass: the amaxes swiglu_fp8_fwd / swiglu_fp8_bwd record (max |h|, or (max |dL/dg|,
    max |dL/du|)), from the same kernel with its stores compiled out, so the scales taken from them are the ones the
    second pass's own amaxes would give."""
    if usable(g):
        return torch.ops.plab.swiglu_amax_fwd(g, u) if dh is None else torch.ops.plab.swiglu_amax_bwd(g, u, dh)
    return swiglu_amax_reference(g, u, dh)
