"""Triton helpers shared by the fused kernels (training/optim_kernels.py, training/precision/*_triton.py):
roundings done on the bits, so that a kernel gives the same bits on the GPU and under Triton's CPU interpreter
(whose float casts truncate) as torch's conversions."""
from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # noqa: BLE001 - any import problem means: no fast path
    HAVE_TRITON = False


def bf16_partials_amax(partial: torch.Tensor) -> torch.Tensor:
    """max over a kernel's per-program partials (each its max |v| rounded to BF16 by the kernel, the bits in int16),
    as the max of the BF16 operand (FP32 result, as fp8_delayed._amax). The rounding is the kernel's: a
    `.to(bfloat16).to(float32)` here would be dropped by inductor, which traces this function into the compiled
    graph. Used by the fused FP8 kernels that write an amax (fp8_swiglu_triton, fp8_rope_triton)."""
    return partial.view(torch.bfloat16).amax().to(torch.float32)


def compiled_for_gpu() -> bool:
    """Whether a kernel launched now is compiled for the GPU rather than run by Triton's CPU interpreter
    (TRITON_INTERPRET=1, read at each launch as Triton does): the kernels' constexpr for the paths only a GPU has
    (hardware FP8 conversion, libdevice)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


if HAVE_TRITON:
    @triton.jit
    def bf16_to_f32(x):
        """BF16 -> FP32 (exact) on the bits: the interpreter's cast mis-scales BF16 subnormals."""
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def bf16_bits_rne(x):
        """FP32 -> BF16 bits (int16), round to nearest even as torch's `.to(torch.bfloat16)`; a NaN stays a
        NaN (0x7FC0)."""
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)

    @triton.jit
    def round_to_e4m3(x):
        """FP32 values with |x| <= 448 rounded onto the E4M3 grid (nearest, ties to even), as torch's cast to
        float8_e4m3fn: 3 mantissa bits for normals (|x| >= 2^-6), multiples of 2^-9 below (subnormals).
        The sign is kept (a negative value that rounds to zero gives -0.0, as the cast)."""
        bits = x.to(tl.int32, bitcast=True)
        sign = bits & -2147483648
        mag_bits = bits & 0x7FFFFFFF
        mag = mag_bits.to(tl.float32, bitcast=True)
        normal = ((mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        # x * 2^9 < 8 is exact; adding and subtracting 1.5 * 2^23 rounds it to an integer, half to even
        # (with fp fusion off nothing reassociates the two).
        sub = ((mag * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        out = tl.where(mag < 0.015625, sub, normal)
        return (out.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def fp8_code_fast(x, FP8_MAX: tl.constexpr, E5M2: tl.constexpr, NATIVE: tl.constexpr):
        """fp8_code's result; NATIVE (on a GPU): by the hardware conversion (cvt.rn.satfinite, round to nearest
        even, the instruction inductor's `.to(float8)` compiles to) after the same clamp, a few instructions
        where fp8_code's bit arithmetic takes ~20 per element; a NaN gives fp8_code's NaN code. Off (Triton's
        interpreter, whose float8 casts are numpy's): fp8_code."""
        if NATIVE:
            v = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
            if E5M2:
                code = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
            else:
                code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            return tl.where(x != x, 0x7F, code).to(tl.uint8)
        else:
            return fp8_code(x, FP8_MAX, E5M2)

    @triton.jit
    def fp8_code(x, FP8_MAX: tl.constexpr, E5M2: tl.constexpr):
        """The FP8 code (uint8) of FP32 `x` as torch's `clamp(x, -max, max).to(float8_e4m3fn / e5m2)`:
        saturated to +-FP8_MAX, rounded to nearest even on the bits (normals keep 3 / 2 mantissa bits, below
        the smallest normal 2^-6 / 2^-14 multiples of 2^-9 / 2^-16), then encoded (bias 7 / 15). A NaN
        gives the format's NaN code."""
        v = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        bits = v.to(tl.int32, bitcast=True)
        sign = ((bits >> 24) & 0x80).to(tl.int32)
        mag_bits = bits & 0x7FFFFFFF
        mag = mag_bits.to(tl.float32, bitcast=True)
        if E5M2:
            rounded = (mag_bits + 0xFFFFF + ((mag_bits >> 21) & 1)) & -2097152  # keep 2 mantissa bits
            normal = ((((rounded >> 23) & 0xFF) - 112) << 2) | ((rounded >> 21) & 3)
            # mag * 2^16 < 4 is exact; +- 1.5 * 2^23 rounds it to an integer, half to even
            sub = ((mag * 65536.0 + 12582912.0) - 12582912.0).to(tl.int32)
            code = tl.where(mag < 6.103515625e-05, sub, normal)
            nan_code = 0x7F
        else:
            rounded = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits
            normal = ((((rounded >> 23) & 0xFF) - 120) << 3) | ((rounded >> 20) & 7)
            sub = ((mag * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
            code = tl.where(mag < 0.015625, sub, normal)
            nan_code = 0x7F
        return tl.where(x != x, nan_code, code | sign).to(tl.uint8)
