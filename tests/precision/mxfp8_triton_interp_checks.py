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
