"""The fused MXFP8 Triton quantizer (training/precision/mxfp8_triton.py) against the torch quantizer of
formats.py (itself bit-exact with torchao), on CPU under Triton's interpreter. The interpreter must be on
before triton is first imported, so test_mxfp8_triton_interpreted.py runs this file in a subprocess with
TRITON_INTERPRET=1; collected directly without it, it skips. The GPU run of the same comparison is
bench/kernel_bench.py."""
from __future__ import annotations

import pytest
import torch

from tests.interpreted import require_interpreter

pytest.importorskip("triton")

from training.precision.formats import quantize_mxfp8  # noqa: E402

require_interpreter("test_mxfp8_triton_interpreted.py")


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from training.precision.mxfp8_triton import _mx_values, _mx_values_direct  # noqa: E402


@triton.jit
def _direct_and_multiply(x_ptr, e_ptr, d_ptr, m_ptr, n, ROUNDING: tl.constexpr, BLOCK: tl.constexpr):
    """Both roundings of `_mxfp8_dual_quant_kernel` element by element, each element with its own exponent."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    e = tl.load(e_ptr + i, mask=i < n, other=127)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    tl.store(d_ptr + i, _mx_values_direct(x, sign, e), mask=i < n)
    tl.store(m_ptr + i, _mx_values(x, e, ROUNDING), mask=i < n)


@pytest.fixture(scope="module")
def mt():
    from training.precision import mxfp8_triton
    return mxfp8_triton


def _operand(rows, cols, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if kind == "heavy":  # Student-t-like tails plus a few x1e4 outliers
        x = x / torch.rand(rows, cols, generator=g).clamp_min(0.02).sqrt()
        x.view(-1)[torch.randint(0, x.numel(), (5,), generator=g)] *= 1e4
    elif kind == "tiny":  # BF16 subnormals and blocks whose scale is E8M0's smallest
        x = x * 1e-38
    elif kind == "wide":  # magnitudes across the whole BF16 range, overflow to inf included
        x = x * torch.exp2(torch.randint(-130, 120, (rows, cols), generator=g).float())
    x = x * torch.exp(torch.randn(rows, 1, generator=g))
    x[1, :32] = 0  # an all-zero block along the columns
    x[32:64, 5] = 0  # an all-zero block along the rows
    return x.bfloat16()


def _same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("kind", ["normal", "heavy", "tiny", "wide"])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("rows,cols,config", [(64, 128, {}), (80, 160, {}),  # 80 x 160: partial tiles, masked
                                              (64, 96, dict(block_n=32, num_warps=1))])
def test_both_outputs_are_bit_exact_with_the_torch_quantizer(mt, kind, rounding, rows, cols, config):
    x = _operand(rows, cols, kind)
    a, b = mt.dual_quantize_launch(x, rounding, **config)
    assert _same_bits(a, quantize_mxfp8(x, scale_rounding=rounding, dtype=torch.bfloat16).values)
    assert _same_bits(b, quantize_mxfp8(x, axis=0, scale_rounding=rounding, dtype=torch.bfloat16).values)


def test_a_strided_operand_is_read_as_its_values(mt):
    x = _operand(64, 256, "normal")[:, ::2]  # column stride 2: made contiguous first
    a, b = mt.mxfp8_dual_quantize(x, "rceil")
    assert _same_bits(a, quantize_mxfp8(x, dtype=torch.bfloat16).values)
    assert _same_bits(b, quantize_mxfp8(x, axis=0, dtype=torch.bfloat16).values)


def test_fused_autograd_function_matches_the_torch_path(mt):
    """MXFP8FusedFn (which operand, which layout, the saved Wgrad and Dgrad operands) against EmulatedLinearFn
    with the same quantizer. The fused path's GEMMs take BF16 values (as on the GPU), the torch path's FP32
    ones on CPU: equal up to BF16 rounding of the products' sums."""
    from training.precision.emulation import EmulatedLinearFn
    from training.precision.mxfp8 import MXFP8Quantizer

    q = MXFP8Quantizer("rceil")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 32, 64, generator=g).bfloat16()
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    dy = torch.randn(2, 32, 96, generator=g).bfloat16()
    outs = []
    for fn, last in ((mt.MXFP8FusedFn, "rceil"), (EmulatedLinearFn, q)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn.apply(xi, wi, None, last)
        y.backward(dy)
        outs.append((y.float(), xi.grad.float(), wi.grad.float()))
    for what, a, b in zip(("Y", "dX", "dW"), *outs):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-2, (what, rel)


def test_direct_rounding_gives_the_multiply_round_multiply_bits_for_every_bf16_value(mt):
    """`_mx_values_direct` (the kernel's path for tiles whose block exponents are all in [FAST_MIN, FAST_MAX])
    against `_mx_values` (torch's arithmetic, op for op): every non-NaN BF16 value (infinities, subnormals and
    zeros of both signs included) under block exponents across that range, both scale roundings."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16).float()
    values = values[~values.isnan()]
    exponents = torch.tensor([mt.FAST_MIN, mt.FAST_MIN + 1, 40, 100, 126, 127, 128, 160, 220,
                              mt.FAST_MAX - 1, mt.FAST_MAX], dtype=torch.int32)
    x = values.repeat(len(exponents))
    e = exponents.repeat_interleave(len(values))
    for rounding in ("rceil", "floor"):
        d = torch.empty(x.shape, dtype=torch.int16)
        m = torch.empty(x.shape, dtype=torch.int16)
        block = 4096
        _direct_and_multiply[(triton.cdiv(x.numel(), block),)](x, e, d, m, x.numel(), ROUNDING=mt.ROUNDINGS[rounding], BLOCK=block)
        bad = (d != m).nonzero().flatten()
        assert bad.numel() == 0, (rounding, [(float(x[i]), int(e[i]), int(d[i]), int(m[i])) for i in bad[:5]])


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_tiles_pick_their_rounding_path_by_their_block_exponents(mt, rounding):
    """One operand whose tiles need different paths: an ordinary tile, a tile with a block of BF16
    subnormals (exponent below FAST_MIN), one with an infinity (above FAST_MAX). "auto" is bit-exact on all;
    forcing the direct rounding is wrong on the extreme tiles (so the per-tile choice is what keeps them
    exact) and right on the ordinary one."""
    x = _operand(96, 128, "normal", seed=3).float()
    x[:, :] = x.clamp(-1e3, 1e3)
    # tile 1: a 32 x 32 block with an amax near 2^-115 (exponent ~4) and values down into BF16's subnormals,
    # where the scaled grid's 3-bit steps are finer than those subnormals' FP32 spacing
    g = torch.Generator().manual_seed(4)
    x[32:64, :32] = torch.randn(32, 32, generator=g) * 1e-35 * torch.exp2(-torch.randint(0, 12, (32, 32), generator=g).float())
    x[70, 9] = float("inf")  # tile 2
    x = x.bfloat16()
    ref_a = quantize_mxfp8(x, scale_rounding=rounding, dtype=torch.bfloat16).values.view(torch.int16)
    ref_b = quantize_mxfp8(x, axis=0, scale_rounding=rounding, dtype=torch.bfloat16).values.view(torch.int16)
    a, b = mt.dual_quantize_launch(x, rounding)
    assert torch.equal(a.view(torch.int16), ref_a) and torch.equal(b.view(torch.int16), ref_b)
    a, b = mt.dual_quantize_launch(x, rounding, path="direct")
    wrong = [bool((a.view(torch.int16)[r] != ref_a[r]).any() | (b.view(torch.int16)[r] != ref_b[r]).any())
             for r in (slice(0, 32), slice(32, 64), slice(64, 96))]
    assert wrong == [False, True, True]
