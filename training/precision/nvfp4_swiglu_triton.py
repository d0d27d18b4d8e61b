"""NVFP4's SwiGLU in one pass per direction, with the per-tensor maxima its operands' quantization needs (GPU fast
path of the emulated NVFP4 MLP, nvfp4.NVFP4SwiGLUMLPFn).

The fused quantizer (nvfp4_triton) reads its operand twice: an amax pass (max |x| and max |RHT(x)|, for the two
per-tensor scales), then the quantize pass. Where the operand is SwiGLU's output h (the down projection's input) or
its backward's dL/dgate and dL/dup (the gate and up projections' dY), the kernel that computes the operand already
holds every value of it: here it also reduces both maxima, so the quantizer's amax pass is skipped
(nvfp4_triton.nvfp4_dual_quantize_given_amax). Per 1b step (16 layers, 8192 tokens x 8192) that is 48 of the 144
amax passes, each a read of a 134 MB operand (bench/NOTES_floor.md 86).

Forward: from the gate and up GEMMs' BF16 results G, U and their FP32 per-tensor scales (the emulated GEMM's product
of the two operands' scales, emulation.emulated_mm), g = G s_g, u = U s_u, h = silu(g) u, stored in BF16. Backward: with
down's Dgrad result DH and its scale, dh = DH s_dh, dL/dg = silu'(g) u dh and dL/du = silu(g) dh. The math is
inductor's, operation for operation, as its compiled step fuses the emulated GEMMs' scale products into the SwiGLU
(torch 2.11, bench/NOTES_floor.md 86): FP32 products of the BF16 results and the scales, not rounded to BF16, silu(g)
= g / (exp(-g) + 1), sigmoid = 1 / (exp(-g) + 1), dL/dg = ((dh u) sigmoid) (g (1 - sigmoid) + 1), dL/du = dh
silu(g) (fp8_swiglu_triton's formulas, the same decomposition of aten.silu_backward), each result rounded once to
BF16 (nearest even). The maxima are those of the stored BF16 values, and of their RHT taken as the amax pass takes it
(nvfp4_triton._rht_tile: one 16 x 16 BF16 dot per 16 tokens, FP32 accumulation), so the scales equal the amax
pass's to the bit.

`nvfp4_swiglu_reference` is the same computation in torch ops (the tests' reference).
"""
from __future__ import annotations

import torch

from training.triton_math import HAVE_TRITON, compiled_for_gpu

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from training.precision.fp8_swiglu_triton import _silu_parts
    from training.precision.nvfp4_triton import _rht_tile, _rht_tile_t
    from training.triton_math import bf16_bits_rne, bf16_to_f32

# A program: GROUPS runs of 16 tokens (each one RHT block) x BLOCK_N features. Measured on an H200 at 8192 x 8192 with
# the host out of the timing (bench/nvfp4_swiglu_probe.py, bench/results/nvfp4_swiglu_probe_*_20261129T0704*, every
# tile the same bits): forward 128 x 2 groups x 4 warps 0.132 ms (256 x 2 x 8 0.133, 128 x 1 x 4 0.147), backward
# 128 x 1 x 4 0.218 ms (128 x 2 x 4 0.241, 64 x 1 x 2 0.222); 1.38x and 1.37x their bytes' floor, against 0.142 and
# 0.255 ms for inductor's SwiGLU kernel plus the amax pass(es) over its result(s).
BLOCK_N, GROUPS, NUM_WARPS = 128, 2, 4  # forward
BWD_GROUPS = 1

if HAVE_TRITON:
    @triton.jit
    def _store_bf16(ptr, rows, cols, N, v, mask, NATIVE: tl.constexpr):
        """Store FP32 `v` as BF16, rounded to nearest even, and return the stored values in FP32 (exact). NATIVE: the
        GPU's conversion instruction (as inductor's store); else on the bits (the interpreter's cast truncates)."""
        if NATIVE:
            b = v.to(tl.bfloat16)
        else:
            b = bf16_bits_rne(v).to(tl.bfloat16, bitcast=True)
        tl.store(ptr + rows[:, None].to(tl.int64) * N + cols[None, :], b, mask=mask)
        return bf16_to_f32(b)

    @triton.jit
    def _rht_max(m, rht_ptr, x, DOT_BF16: tl.constexpr, TRANSPOSED: tl.constexpr):
        """max(m, |RHT(x)|) for a (16, BLOCK) tile x: RHT(x) as the amax pass's _rht_tile, (16, BLOCK), or transposed
        ((BLOCK, 16): x^T @ rht, the quantize pass's product, one wgmma with M = BLOCK on Hopper), m of that shape.
        Only the maximum is kept, which is the same either way if the two products' sums are."""
        if TRANSPOSED:
            y = _rht_tile_t(rht_ptr, x, DOT_BF16)
        else:
            y = _rht_tile(rht_ptr, x, DOT_BF16)
        return tl.maximum(m, tl.abs(y))

    @triton.jit
    def _nvfp4_swiglu_kernel(g_ptr, u_ptr, dh_ptr, sg_ptr, su_ptr, sdh_ptr, rht_ptr, oa_ptr, ob_ptr, partial_ptr,
                             M, N, stride_g, stride_u, stride_dh, BACKWARD: tl.constexpr, HAS_RHT: tl.constexpr,
                             DOT_BF16: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr,
                             GROUPS: tl.constexpr, K: tl.constexpr, NATIVE: tl.constexpr,
                             TRANSPOSED: tl.constexpr):
        pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        sg = tl.load(sg_ptr)
        su = tl.load(su_ptr)
        max_a = tl.zeros((16, BLOCK), dtype=tl.float32)
        max_b = tl.zeros((16, BLOCK), dtype=tl.float32)
        if TRANSPOSED:
            max_ar = tl.zeros((BLOCK, 16), dtype=tl.float32)
            max_br = tl.zeros((BLOCK, 16), dtype=tl.float32)
        else:
            max_ar = tl.zeros((16, BLOCK), dtype=tl.float32)
            max_br = tl.zeros((16, BLOCK), dtype=tl.float32)
        for grp in tl.static_range(GROUPS):
            rows = (tl.program_id(0) * GROUPS + grp) * 16 + tl.arange(0, 16)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            r = rows[:, None].to(tl.int64)
            g = bf16_to_f32(tl.load(g_ptr + r * stride_g + cols[None, :], mask=mask, other=0.0)) * sg
            u = bf16_to_f32(tl.load(u_ptr + r * stride_u + cols[None, :], mask=mask, other=0.0)) * su
            silu, sig = _silu_parts(g, LIBDEVICE)
            if BACKWARD:
                dh = bf16_to_f32(tl.load(dh_ptr + r * stride_dh + cols[None, :], mask=mask, other=0.0)) * \
                    tl.load(sdh_ptr)
                a = _store_bf16(oa_ptr, rows, cols, N, ((dh * u) * sig) * (g * (1.0 - sig) + 1.0), mask,
                                NATIVE)  # dL/dg
                b = _store_bf16(ob_ptr, rows, cols, N, dh * silu, mask, NATIVE)  # dL/du
                max_b = tl.maximum(max_b, tl.abs(b))
                if HAS_RHT:
                    max_br = _rht_max(max_br, rht_ptr, b, DOT_BF16, TRANSPOSED)
            else:
                a = _store_bf16(oa_ptr, rows, cols, N, silu * u, mask, NATIVE)  # h
            max_a = tl.maximum(max_a, tl.abs(a))
            if HAS_RHT:
                max_ar = _rht_max(max_ar, rht_ptr, a, DOT_BF16, TRANSPOSED)
        amax_a = tl.max(tl.max(max_a, axis=1), axis=0)
        amax_ar = amax_a  # without RHT the RHT maxima repeat the plain ones (nvfp4_triton's amax pass)
        if HAS_RHT:
            amax_ar = tl.max(tl.max(max_ar, axis=1), axis=0)
        tl.store(partial_ptr + K * pid, amax_a)
        tl.store(partial_ptr + K * pid + 1, amax_ar)
        if BACKWARD:
            amax_b = tl.max(tl.max(max_b, axis=1), axis=0)
            amax_br = amax_b
            if HAS_RHT:
                amax_br = tl.max(tl.max(max_br, axis=1), axis=0)
            tl.store(partial_ptr + K * pid + 2, amax_b)
            tl.store(partial_ptr + K * pid + 3, amax_br)


def swiglu_launch(g, u, dh, s_g, s_u, s_dh, rht_t, rht: bool, *, wrap=lambda kernel: kernel, block_n: int = BLOCK_N,
                  groups: int = GROUPS, num_warps: int = NUM_WARPS, native: bool | None = None,
                  transposed: bool = False):
    """Launch the kernel (under the interpreter too). Forward (dh None): (h, amax) with amax = [max |h|, max
    |RHT(h)|] (FP32, the layout nvfp4_dual_quantize_given_amax takes). Backward: (dL/dg, dL/du, amax) with amax =
    [max |dL/dg|, max |RHT(dL/dg)|, max |dL/du|, max |RHT(dL/du)|]. Without `rht` the RHT maxima repeat the plain
    ones. g, u, dh: BF16 [tokens, features] with unit column stride; s_*: FP32 one-element tensors; rht_t: the
    quantizer's rht_operand. `native`: round to BF16 with the GPU's instruction (default: where compiled for one);
    `transposed`: the RHT's product as the quantize pass takes it (x^T @ rht) rather than as the amax pass does."""
    m, n = g.shape
    backward = dh is not None
    assert g.dtype == u.dtype == torch.bfloat16 and (dh is None or dh.dtype == torch.bfloat16), "BF16 operands"
    assert g.stride(1) == u.stride(1) == 1 and (dh is None or dh.stride(1) == 1), "unit column stride"
    grid = (triton.cdiv(m, 16 * groups), triton.cdiv(n, block_n))
    k = 4 if backward else 2
    partial = torch.empty((grid[0] * grid[1], k), device=g.device, dtype=torch.float32)
    oa = torch.empty((m, n), device=g.device, dtype=torch.bfloat16)
    ob = torch.empty((m, n), device=g.device, dtype=torch.bfloat16) if backward else oa
    wrap(_nvfp4_swiglu_kernel)[grid](g, u, dh if backward else g, s_g, s_u, s_dh if backward else s_g, rht_t, oa, ob,
                                     partial, m, n, g.stride(0), u.stride(0), dh.stride(0) if backward else 0,
                                     BACKWARD=backward, HAS_RHT=rht, DOT_BF16=g.is_cuda,
                                     LIBDEVICE=compiled_for_gpu(), BLOCK=block_n, GROUPS=groups, K=k,
                                     NATIVE=compiled_for_gpu() if native is None else native, TRANSPOSED=transposed,
                                     num_warps=num_warps)
    amax = partial.amax(dim=0)
    return (oa, ob, amax) if backward else (oa, amax)


if HAVE_TRITON:
    from torch.library import triton_op, wrap_triton

    @triton_op("plab::nvfp4_swiglu_fwd", mutates_args=())
    def _fwd_op(g: torch.Tensor, u: torch.Tensor, s_g: torch.Tensor, s_u: torch.Tensor, rht_t: torch.Tensor,
                rht: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return swiglu_launch(g, u, None, s_g, s_u, None, rht_t, rht, wrap=wrap_triton)

    @triton_op("plab::nvfp4_swiglu_bwd", mutates_args=())
    def _bwd_op(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, s_g: torch.Tensor, s_u: torch.Tensor,
                s_dh: torch.Tensor, rht_t: torch.Tensor, rht: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return swiglu_launch(g, u, dh, s_g, s_u, s_dh, rht_t, rht, wrap=wrap_triton, groups=BWD_GROUPS)


def nvfp4_swiglu_fwd(g, u, s_g, s_u, rht_t, *, rht: bool):
    """(h, amax): h = silu(g s_g) (u s_u) in BF16 and amax = [max |h|, max |RHT(h)|] (the module docstring)."""
    return torch.ops.plab.nvfp4_swiglu_fwd(g, u, s_g, s_u, rht_t, rht)


def nvfp4_swiglu_bwd(g, u, dh, s_g, s_u, s_dh, rht_t, *, rht: bool):
    """(dL/dg, amax_dg, dL/du, amax_du): the SwiGLU backward in BF16 from dh = dh s_dh, each with [max |v|,
    max |RHT(v)|]."""
    dg, du, amax = torch.ops.plab.nvfp4_swiglu_bwd(g, u, dh, s_g, s_u, s_dh, rht_t, rht)
    return dg, amax[0:2], du, amax[2:4]


def nvfp4_swiglu_reference(g, u, s_g, s_u, dh=None, s_dh=None, exp=torch.exp):
    """The kernel's values in torch ops (FP32 from the BF16 inputs and the scales, one rounding to BF16): h, or
    (dL/dg, dL/du) with dh. Its maxima are those of these tensors and of their RHT (nvfp4_triton's amax pass).
    `exp`: the exponential the kernel's math takes (libdevice's on a GPU; numpy's under Triton's interpreter, which
    can differ from torch's CPU exp in the last bit)."""
    gf, uf = g.float() * s_g, u.float() * s_u
    e = exp(-gf) + 1.0
    silu, sig = gf / e, 1.0 / e
    if dh is None:
        return (silu * uf).to(torch.bfloat16)
    dhf = dh.float() * s_dh
    return (((dhf * uf) * sig) * (gf * (1.0 - sig) + 1.0)).to(torch.bfloat16), (dhf * silu).to(torch.bfloat16)
