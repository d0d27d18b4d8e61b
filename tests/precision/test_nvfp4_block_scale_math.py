"""The arithmetic of the fused NVFP4 kernel's block scales (training/precision/nvfp4_triton.py `_nvfp4_values` and
`_operand_constants`) against the IEEE divisions it replaces, in numpy with exact FP32 operations:

    old: e4m3 = E4M3(clamp(RN(block_scale / pts))),          reciprocal = RN(RN(1 / pts) / e4m3)
    new: q = block_scale s * RN(1 / (pts s)), corrected twice by FMAs,  reciprocal = RN(RN(1 / pts) / m) 2^-k

with block_scale = max / 6 (max * RN(1 / 6) on the GPU), pts = amax / 2688 (amax * RN(1 / 2688)), s = 2^64 where
pts < 2^-64, and e4m3 = m 2^k. Both must give the same (e4m3, reciprocal) bits for every input. The fused kernel's
outputs against the torch quantizers on real operands are test_nvfp4_triton_interpreted.py's."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

f32, f64 = np.float32, np.float64


def fma32(a, b, c):
    """RN32(a b + c), exactly: the product is exact in FP64, the sum's error by TwoSum, and the FP64 sum rounded to
    odd before the rounding to FP32 (53 >= 24 + 2 bits: no double rounding)."""
    a, b, c = (np.asarray(t, f32).astype(f64) for t in (a, b, c))
    p = a * b
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        bp = s - c
        e = (p - bp) + (c - (s - bp))
        odd = (s.view(np.int64) & 1) == 1
        s = np.where((e != 0) & ~odd & np.isfinite(s), np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
        return s.astype(f32)


def div32(a, b):
    """RN32(a / b): the FP64 quotient rounded to FP32 is correctly rounded for FP32 operands (53 >= 2 * 24 + 2)."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return (np.asarray(a, f32).astype(f64) / np.asarray(b, f32).astype(f64)).astype(f32)


def mul32(a, b):
    with np.errstate(over="ignore"):
        return (np.asarray(a, f32).astype(f64) * np.asarray(b, f32).astype(f64)).astype(f32)


def e4m3_of(q):
    """The kernel's _round_e4m3 of the clamped scale, on the bits."""
    bits = np.minimum(np.maximum(q, f32(2.0 ** -6)), f32(448.0)).view(np.int32).astype(np.int64)
    return ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).astype(np.uint32).view(f32)


def block_scale(mx, gpu: bool):
    return mul32(mx, f32(1.0 / 6.0)) if gpu else div32(mx, f32(6.0))


def tensor_scale(amax, gpu: bool):
    return mul32(amax, f32(1.0 / 2688.0)) if gpu else div32(amax, f32(2688.0))


def by_division(mx, amax, gpu: bool):
    """(e4m3, reciprocal) as formats._nvfp4_blocked computes them (the kernel before: IEEE divisions)."""
    pts = tensor_scale(amax, gpu)
    e = e4m3_of(div32(block_scale(mx, gpu), pts))
    return e, div32(div32(f32(1.0), pts), e)


def constants(pts):
    """_operand_constants: (s, pts s, RN(1 / (pts s)), the table RN(RN(1 / pts) / (1 + i / 8)))."""
    s = f32(2.0 ** 64) if pts < f32(2.0 ** -64) else f32(1.0)
    pts_s = mul32(pts, s)
    return s, pts_s, div32(f32(1.0), pts_s), div32(div32(f32(1.0), pts), (1 + np.arange(8) / 8).astype(f32))


def quotient(bs, pts, corrections=2):
    s, pts_s, rs, _ = constants(pts)
    bs = mul32(bs, s)
    q = mul32(bs, rs)
    for _ in range(corrections):
        q = fma32(fma32(-pts_s, q, bs), rs, q)
    return q


def by_kernel(mx, amax, gpu: bool, corrections=2):
    """(e4m3, reciprocal) as _nvfp4_values computes them now."""
    pts = tensor_scale(amax, gpu)
    e = e4m3_of(quotient(block_scale(mx, gpu), pts, corrections))
    eb = e.view(np.int32)
    table = constants(pts)[3]
    return e, mul32(table[(eb >> 20) & 7], (0x7F000000 - (eb & 0x7F800000)).astype(np.int32).view(f32))


def mismatches(mx, amax, gpu, corrections=2):
    e0, r0 = by_division(mx, amax, gpu)
    e1, r1 = by_kernel(mx, amax, gpu, corrections)
    return int(((e0.view(np.int32) != e1.view(np.int32)) | (r0.view(np.int32) != r1.view(np.int32))).sum())


BF16 = (np.arange(1, 0x7F80, dtype=np.uint32) << 16).view(f32)  # every positive finite BF16, subnormals included


def test_fma_emulation_is_exact():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 500)).astype(f32)
    c = (rng.standard_normal(500) * 1e-3).astype(f32)
    for x, y, z, got in zip(a, b, c, fma32(a, b, c)):
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        near = np.float32(float(exact))
        cands = (np.nextafter(near, f32(-np.inf)), near, np.nextafter(near, f32(np.inf)))
        want = min(cands, key=lambda t: (abs(Fraction(float(t)) - exact), int(np.array(t).view(np.int32)) & 1))
        assert got == want


@pytest.mark.parametrize("gpu", [True, False])
def test_bf16_block_and_tensor_maxima_give_the_divisions_bits(gpu):
    """Activations and gradients are BF16, so `a`'s block maxima and both amaxes are BF16 values: every pair (max <=
    amax) over every 13th amax here, subnormals to the largest (all 5.3e8 pairs: 0 mismatches, bench/NOTES_floor.md
    82)."""
    for amax in BF16[::13]:
        assert mismatches(BF16[BF16 <= amax], amax, gpu) == 0, amax


@pytest.mark.parametrize("gpu", [True, False])
def test_fp32_maxima_give_the_divisions_bits(gpu):
    """`b`'s block maxima and amax are FP32 sums (the RHT): random ones over the whole range, and quotients next to
    FP32 rounding ties (block_scale = RN(tie * pts) and its neighbours) for the correction steps alone."""
    rng = np.random.default_rng(1)
    for _ in range(12):
        amax = f32(np.exp2(rng.uniform(-149, 127.99)))
        if amax == 0 or tensor_scale(amax, gpu) == 0:
            continue
        mx = np.minimum(np.exp2(rng.uniform(-149, np.log2(amax), 200_000)).astype(f32), amax)
        assert mismatches(mx[mx > 0], amax, gpu) == 0, amax
        pts = tensor_scale(amax, gpu)
        sig = rng.integers(1 << 24, 1 << 25, 100_000) | 1  # odd 25-bit significands: midpoints of FP32 numbers
        ties = np.ldexp(sig.astype(f64), rng.integers(-30, 30, sig.size) - 24)
        with np.errstate(over="ignore"):
            bs = (ties * f64(pts)).astype(f32)
        for b in (np.nextafter(bs, f32(-np.inf)), bs, np.nextafter(bs, f32(np.inf))):
            want = div32(b, pts)
            ok = (b > 2.0 ** -100) & (want > 2.0 ** -100) & (want < 3e38)
            assert int((quotient(b, pts) != want)[ok].sum()) == 0


def test_one_correction_is_not_enough_for_the_quotient():
    """Why two: with one FMA correction the quotient is off by an ulp for some BF16 pairs (and with none, the E4M3
    scale too), so the checks above can tell."""
    amax = f32(896.0)
    mx = BF16[BF16 <= amax]
    pts = tensor_scale(amax, False)
    bs = block_scale(mx, False)
    assert int((quotient(bs, pts, 1) != div32(bs, pts)).sum()) > 0
    assert mismatches(mx, amax, False, corrections=0) > 0
    assert mismatches(mx, f32(49.0), True, corrections=0) > 0
