"""Fused MXFP8 quantization of one GEMM operand into both layouts it is needed in (GPU fast path of the
emulated `mxfp8` recipe).

Each operand of a linear layer is quantized twice by MXFP8: X in 1x32 blocks along the features (Fprop) and
along the tokens (Wgrad), W along in_features (Fprop) and out_features (Dgrad), dY along out_features
(Dgrad) and the tokens (Wgrad). With the torch quantizers of formats.py that is two passes per operand, each
reading it and writing BF16 values (>= 8 bytes per BF16 element, and the backward re-reads the saved X and
W). Here one pass reads each 32-row x BLOCK_N-column tile once and writes both layouts (6 bytes per element):
output `a` with 1x32 blocks along dim 1, output `b` with 32x1 blocks along dim 0, both BF16 in the input's
[rows, cols] layout (the GEMMs read `b` transposed, in place). MX scales are local to a block, so unlike
NVFP4 there is no global-amax pass.

The arithmetic is formats.quantize_mxfp8's (torchao `to_mx`) operation for operation, with the
transcendental steps done on the bits: rceil's ceil(log2(amax / 448)) from the exponent and mantissa bits of
the FP32 quotient, the E4M3 rounding on the bits (triton_math.round_to_e4m3), the E8M0 scale as an exponent
field. For every positive BF16 amax (all 32,639 checked) that ceil equals torch's log2-then-ceil, whether the
quotient is an IEEE division (torch on CPU) or a multiplication by the FP32 reciprocal of 448 (torch's CUDA
division by a Python scalar): the quotient is an exact power of two, one rounding below one, or far from one. So both outputs are bit-identical with `quantize_mxfp8(x, axis=..., dtype=
torch.bfloat16).values` (tests under Triton's interpreter on CPU; bench/kernel_bench.py on the GPU).

Most tiles skip that arithmetic's two multiplications (by 1/scale, then by the scale) and its BF16 rounding:
for block exponents in [FAST_MIN, FAST_MAX] (block maxima between ~2^-106 and ~2^107) the kernel rounds the
clamped value straight onto the scaled E4M3 grid with the FP32 adder (`_mx_values_direct`), which gives the
same bits (checked for every BF16 value under exponents across that range); a tile with any block outside
takes the multiply-round-multiply path. About half the operations per element: the kernel is bound by them,
not by memory (bench/results/mxfp8_kernel_bench_2026-11-24T1847_*: 8192 x 8192 in 0.164 ms, 2.5 TB/s
effective, against 0.190 ms before).

`mxfp8_dual_quantize` is a `torch.library.triton_op`, so torch.compile calls the kernel from the compiled
graph. It takes a 2D BF16 tensor whose column count is a multiple of 32 (rows: any; zero padding does not
change a block's amax, as formats.py pads).
"""
from __future__ import annotations

import torch

from training.triton_math import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from training.triton_math import bf16_bits_rne, bf16_to_f32, round_to_e4m3

BLOCK = 32
BLOCK_N = 128  # columns per program (4 blocks of 32 along dim 1)
# bench/results/mxfp8_kernel_bench_2026-11-24T1847_*: 2 warps fastest on the large operands (8192 x 8192: 0.164 ms,
# 4 warps 0.172); the small ones are launch-bound in that timing
NUM_WARPS = 2
ROUNDINGS = {"rceil": 0, "floor": 1}
# Block exponents (biased E8M0) for which _mx_values_direct gives _mx_values' bits: s = 2^(E - 127) >= 2^-115
# keeps BF16 subnormal inputs below E4M3's smallest step and every result an FP32 normal; s <= 2^98 keeps the
# adder's constants finite (a clamped |v| <= 448 s < 2^107, so 1.5 * 2^(e + 20) <= 1.5 * 2^126). A tile with
# any block outside (amax below ~2^-106 or above ~2^107, inf, NaN) takes the multiply-round-multiply path.
FAST_MIN = 12
FAST_MAX = 225
PATHS = {"auto": 0, "direct": 1, "multiply": 2}

if HAVE_TRITON:
    _FAST_MIN = tl.constexpr(FAST_MIN)
    _FAST_MAX = tl.constexpr(FAST_MAX)

    @triton.jit
    def _ceil_log2_positive(d):
        """ceil(log2(d)) for FP32 d > 0 (finite; subnormals included), from the bits."""
        bits = d.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        normal = biased - 127 + (mantissa != 0).to(tl.int32)
        # subnormal d = mantissa * 2^-149 < 2^-126: ceil is -126 above 2^-127, else -127 or less (clamped anyway)
        return tl.where(biased == 0, tl.where(mantissa > 0x400000, -126, -127), normal)

    @triton.jit
    def _mx_exponent(max_abs, ROUNDING: tl.constexpr):
        """The biased E8M0 exponent (int32) of blocks with maxima `max_abs`: formats.mxfp8_block_scales."""
        if ROUNDING == 0:  # rceil: 2^ceil(log2(amax / 448)); never saturates the block max
            descale = tl.math.div_rn(max_abs, 448.0)
            e = tl.minimum(tl.maximum(_ceil_log2_positive(descale), -127), 127)
            e = tl.where(descale == 0, -127, e)
            is_inf = descale.to(tl.int32, bitcast=True) == 0x7F800000
            exponent = tl.where(descale != descale, 255, tl.where(is_inf, 254, e + 127))
        else:  # floor (OCP): 2^(floor(log2 amax) - 8), read off the exponent bits
            unbiased = ((max_abs.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 135
            exponent = tl.minimum(tl.maximum(unbiased, -127), 128) + 127
            exponent = tl.where(max_abs != max_abs, 255, exponent)
        return exponent

    @triton.jit
    def _mx_values(data, exponent, ROUNDING: tl.constexpr):
        """E4M3 element x E8M0 scale, FP32, for FP32 `data` and its blocks' exponents (broadcastable):
        formats.quantize_mxfp8, op for op, torch's special cases included (exponents 0, 254, 255)."""
        if ROUNDING == 0:
            # multiplier 2^(127 - exponent) as an exponent field; torch's special cases for 0, 254 and 255
            pow2 = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
            descale_nan = (tl.zeros_like(exponent) + 0x7FC00000).to(tl.float32, bitcast=True)
            multiplier = tl.where(exponent == 255, descale_nan, tl.where(
                exponent == 254, 5.877471754111438e-39, tl.where(exponent == 0, 1.0, pow2)))
            scaled = data * multiplier
        else:
            scale = tl.maximum((exponent << 23).to(tl.float32, bitcast=True), 1.1754943508222875e-38)
            scaled = tl.math.div_rn(data, scale)
        code = round_to_e4m3(tl.minimum(tl.maximum(scaled, -448.0), 448.0))
        # e8m0_to_fp32: 2^(exponent - 127) (2^-127 for exponent 0, a subnormal), NaN for 255
        e8m0 = tl.where(exponent == 0, 5.877471754111438e-39, (exponent << 23).to(tl.float32, bitcast=True))
        e8m0 = tl.where(exponent == 255, (tl.zeros_like(exponent) + 0x7FC00000).to(tl.float32, bitcast=True), e8m0)
        return bf16_bits_rne(code * e8m0)

    @triton.jit
    def _mx_values_direct(data, sign, exponent):
        """The same BF16 bits as `_mx_values` for blocks with FAST_MIN <= exponent <= FAST_MAX, in a third of
        its operations: with s = 2^(exponent - 127), code x e8m0 = round(clamp(data, +-448 s)) onto E4M3's grid
        scaled by s (3 mantissa bits at and above 2^-6 s, multiples of 2^-9 s below), so neither the
        multiplication by 1/s nor the one by s is needed. The rounding is the FP32 adder's (ties to even): v + M
        with M = 1.5 * 2^(e + 20) for v's exponent e (the spacing of FP32 numbers near M is 2^(e - 3)), or
        M = 1.5 * 2^14 s for E4M3's subnormal steps 2^-9 s, whichever is larger - the larger M is the
        coarser grid, which is the one v's magnitude selects. In that exponent range s >= 2^-115: every
        nonzero result is an FP32 normal with at most 4 significant bits, so its BF16 is its top 16 bits, and
        BF16 subnormal inputs (< 2^-126) all round to zero as they do through the multiplications; the clamped
        |v| < 2^107 keeps M finite. `sign`: data's sign bit (a result of zero keeps it, as torch's cast)."""
        s = (exponent << 23).to(tl.float32, bitcast=True)
        lim = 448.0 * s
        v = tl.minimum(tl.maximum(data, -lim), lim)
        m_normal = (((v.to(tl.int32, bitcast=True) & 0x7F800000) + (20 << 23)) | 0x400000).to(tl.float32,
                                                                                                bitcast=True)
        m = tl.maximum(m_normal, 24576.0 * s)
        r = (v + m) - m
        return ((r.to(tl.int32, bitcast=True) | sign) >> 16).to(tl.int16)

    @triton.jit
    def _mxfp8_dual_quant_kernel(x_ptr, a_ptr, b_ptr, M, N, stride_m, BLOCK_N: tl.constexpr,
                                 ROUNDING: tl.constexpr, PATH: tl.constexpr):
        rows = tl.program_id(0) * 32 + tl.arange(0, 32)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = bf16_to_f32(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=mask, other=0.0))
        # a: 1x32 blocks along the columns (N is a multiple of 32, so a block is all in or all out);
        # b: 32x1 blocks along the rows (one block per column of the tile; masked rows are zeros)
        blocks = tl.reshape(x, (32, BLOCK_N // 32, 32))
        ea = _mx_exponent(tl.max(tl.abs(blocks), axis=2), ROUNDING)
        eb = _mx_exponent(tl.max(tl.abs(x), axis=0), ROUNDING)
        if PATH == 0:  # per tile: the direct rounding when every block's exponent allows it (all but extremes)
            lo = tl.minimum(tl.min(tl.min(ea, axis=1), axis=0), tl.min(eb, axis=0))
            hi = tl.maximum(tl.max(tl.max(ea, axis=1), axis=0), tl.max(eb, axis=0))
            direct = (lo >= _FAST_MIN) & (hi <= _FAST_MAX)
        else:
            direct = PATH == 1
        if direct:
            sign = x.to(tl.int32, bitcast=True) & -2147483648
            va = tl.reshape(_mx_values_direct(blocks, tl.reshape(sign, (32, BLOCK_N // 32, 32)), ea[:, :, None]),
                            (32, BLOCK_N))
            vb = _mx_values_direct(x, sign, eb[None, :])
        else:
            va = tl.reshape(_mx_values(blocks, ea[:, :, None], ROUNDING), (32, BLOCK_N))
            vb = _mx_values(x, eb[None, :], ROUNDING)
        tl.store(a_ptr + rows[:, None] * N + cols[None, :], va.to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(b_ptr + rows[:, None] * N + cols[None, :], vb.to(tl.bfloat16, bitcast=True), mask=mask)


def dual_quantize_launch(x: torch.Tensor, scale_rounding: str, wrap=lambda kernel: kernel, *,
                         block_n: int = BLOCK_N, num_warps: int = NUM_WARPS, path: str = "auto"):
    """Launch the kernel (under the interpreter too): (a, b) as in the module docstring. `path` (tests and
    benchmarks): "auto" picks per tile; "direct" forces the short rounding (valid only for tiles whose block
    exponents are all in [FAST_MIN, FAST_MAX]); "multiply" forces the long one."""
    m, n = x.shape
    a = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    b = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(m, 32), triton.cdiv(n, block_n))
    # (fp fusion cannot change a bit here: every product is by a power of two, hence exact)
    wrap(_mxfp8_dual_quant_kernel)[grid](x, a, b, m, n, x.stride(0), BLOCK_N=block_n,
                                         ROUNDING=ROUNDINGS[scale_rounding], PATH=PATHS[path],
                                         num_warps=num_warps)
    return a, b


if HAVE_TRITON:
    from torch.library import triton_op, wrap_triton

    @triton_op("plab::mxfp8_dual_quantize", mutates_args=())
    def _dual_quantize_op(x: torch.Tensor, scale_rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
        return dual_quantize_launch(x, scale_rounding, wrap=wrap_triton)


def mxfp8_dual_quantize(x: torch.Tensor, scale_rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b): MXFP8 values (E4M3 x E8M0, BF16) of the 2D BF16 tensor x with 1x32 blocks along dim 1 (`a`)
    and along dim 0 (`b`), both of x's shape. x.shape[1] must be a multiple of 32."""
    if x.stride(1) != 1:  # the kernel reads rows with unit stride along the columns
        x = x.contiguous()
    return torch.ops.plab.mxfp8_dual_quantize(x, scale_rounding)


class MXFP8FusedFn(torch.autograd.Function):
    """The emulated MXFP8 linear on the GPU fast path: X, W and dY each quantized once into both layouts they
    are needed in. Forward saves X's Wgrad operand and W's Dgrad operand (BF16, their sizes) instead of X
    and W. Same quantized values (bit for bit), same GEMMs in the same operand layouts as EmulatedLinearFn
    with mxfp8.MXFP8Quantizer on the GPU, so the same results."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, scale_rounding: str, wa=None, wb=None):
        """`wa`, `wb`: W's two layouts from the per-step weight cache (QuantizedLinear), or None."""
        from training.precision.emulation import compute_dtype, emulated_mm
        from training.precision.formats import Quantized

        out_dtype = compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1]).to(out_dtype)
        xa, xb = mxfp8_dual_quantize(x2, scale_rounding)
        if wa is None:
            wa, wb = mxfp8_dual_quantize(weight, scale_rounding)
        y = emulated_mm(Quantized(xa), Quantized(wa), out_dtype, bias)
        ctx.save_for_backward(xb, wb)
        ctx.scale_rounding = scale_rounding
        ctx.has_bias = bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        from training.precision.emulation import emulated_mm
        from training.precision.formats import Quantized

        xb, wb = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16)
        dya, dyb = mxfp8_dual_quantize(dy2, ctx.scale_rounding)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = emulated_mm(Quantized(dya), Quantized(wb).t(), ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = emulated_mm(Quantized(dyb).t(), Quantized(xb).t(), ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy2.to(torch.float32).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None
