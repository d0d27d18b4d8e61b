"""Fused FP8 cast + transpose + amax of one GEMM operand (GPU fast path of `fp8_delayed`'s real GEMMs).

torch._scaled_mm wants its first operand row-major and its second column-major, so each operand of a linear
layer is needed in FP8 in both layouts (X: row-major for Fprop, transposed for Wgrad; W: row-major for Fprop,
transposed for Dgrad; dY: row-major for Dgrad, transposed for Wgrad), and delayed scaling records each
operand's amax. With torch ops that is an amax pass, a cast pass and a transposing copy of the FP8 tensor
(2 + 3 + 2 = 7 bytes per BF16 element). Here one pass reads each BM x BN tile once, records its |x| maximum
(a partial, reduced after the kernel: no atomics on one address), and writes the FP8 codes in both layouts:
4 bytes per element, as Transformer Engine's cast-transpose. The scale comes in as a device tensor (from the
amax history), so nothing waits for the host.

The codes are `clamp(x * scale, -max, max).to(fp8)` exactly (formats.fp8_cast): an FP32 product, then on a GPU
the hardware conversion the compiled torch cast uses (triton_math.fp8_code_fast), under Triton's interpreter the
rounding and encoding done on the bits (triton_math.fp8_code), so the outputs are bit-identical with the torch cast
on the GPU and under the interpreter (the tests).

`fp8_cast_transpose` is a `torch.library.triton_op`, so torch.compile calls the kernel from the compiled graph.
It takes a 2D BF16 or FP32 tensor (any row stride, unit column stride).
"""
from __future__ import annotations

import torch

from training.triton_math import HAVE_TRITON, compiled_for_gpu

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from training.triton_math import bf16_to_f32, fp8_code_fast

BM = BN = 64
NUM_WARPS = 4
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

if HAVE_TRITON:
    @triton.jit
    def _fp8_cast_transpose_kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, partial_ptr, M, N, stride_m,
                                   FP8_MAX: tl.constexpr, E5M2: tl.constexpr, X_BF16: tl.constexpr,
                                   NATIVE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        raw = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=mask, other=0.0)
        x = bf16_to_f32(raw) if X_BF16 else raw.to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        tl.store(partial_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), amax)
        code = fp8_code_fast(x * tl.load(scale_ptr), FP8_MAX, E5M2, NATIVE)
        code = code.to(q_ptr.dtype.element_ty, bitcast=True)
        tl.store(q_ptr + rows[:, None] * N + cols[None, :], code, mask=mask)
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(code), mask=tl.trans(mask))


def cast_transpose_launch(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                          wrap=lambda kernel: kernel, *, bm: int = BM, bn: int = BN, num_warps: int = NUM_WARPS):
    """Launch the kernel (under the interpreter too): (q [M, N], qt [N, M], amax) as in the docstring."""
    m, n = x.shape
    q = torch.empty((m, n), device=x.device, dtype=fp8_dtype)
    qt = torch.empty((n, m), device=x.device, dtype=fp8_dtype)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    partial = torch.empty(grid[0] * grid[1], device=x.device, dtype=torch.float32)
    wrap(_fp8_cast_transpose_kernel)[grid](x, scale, q, qt, partial, m, n, x.stride(0),
                                           FP8_MAX=FP8_MAX[fp8_dtype], E5M2=fp8_dtype == torch.float8_e5m2,
                                           X_BF16=x.dtype == torch.bfloat16,
                                           NATIVE=compiled_for_gpu(), BM=bm, BN=bn,
                                           num_warps=num_warps)
    return q, qt, partial.amax()


if HAVE_TRITON:
    from torch.library import triton_op, wrap_triton

    @triton_op("plab::fp8_cast_transpose", mutates_args=())
    def _cast_transpose_op(x: torch.Tensor, scale: torch.Tensor,
                           e5m2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return cast_transpose_launch(x, scale, torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn,
                                     wrap=wrap_triton)


TM, TN = 64, 128  # the transpose's tile: 128-byte rows read, 64-byte rows written per warp's share

if HAVE_TRITON:
    @triton.jit
    def _fp8_transpose_kernel(x_ptr, y_ptr, M, N, TM: tl.constexpr, TN: tl.constexpr):
        rows = tl.program_id(0) * TM + tl.arange(0, TM)
        cols = tl.program_id(1) * TN + tl.arange(0, TN)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tile = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask)
        tl.store(y_ptr + cols[:, None] * M + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


def byte_transpose_launch(x: torch.Tensor, wrap=lambda kernel: kernel) -> torch.Tensor:
    """x.t().contiguous() for a contiguous 2D tensor of a 1-byte dtype (FP8 codes loaded and stored as they are)."""
    m, n = x.shape
    y = torch.empty((n, m), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, TM), triton.cdiv(n, TN))
    wrap(_fp8_transpose_kernel)[grid](x, y, m, n, TM=TM, TN=TN, num_warps=4)
    return y


if HAVE_TRITON:
    @triton_op("plab::fp8_transpose", mutates_args=())
    def _transpose_op(x: torch.Tensor) -> torch.Tensor:
        return byte_transpose_launch(x, wrap=wrap_triton)


def fp8_transpose(q: torch.Tensor) -> torch.Tensor:
    """q.t().contiguous() for FP8 codes, as a kernel torch.compile calls but does not fuse into q's producer:
    q is written once (row-major, its cast fused with the amax reduction) and its transposed layout copied
    from its 1-byte codes, where an inlined transpose re-reads (and recomputes) the BF16 source. CPU, or no
    Triton: the torch copy."""
    if not (HAVE_TRITON and q.is_cuda) or q.dim() != 2:
        return q.t().contiguous()
    return torch.ops.plab.fp8_transpose(q.contiguous())


def fp8_cast_transpose(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype):
    """(q, qt, amax): the FP8 codes of clamp(x * scale) in x's layout and transposed (both contiguous), and
    max |x| (FP32). x: 2D BF16/FP32; scale: an FP32 device scalar."""
    if x.stride(1) != 1:
        x = x.contiguous()
    return torch.ops.plab.fp8_cast_transpose(x, scale, fp8_dtype == torch.float8_e5m2)
