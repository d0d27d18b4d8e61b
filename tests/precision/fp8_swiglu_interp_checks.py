"""fp8_delayed's fused SwiGLU kernel (training/precision/fp8_swiglu_triton.py) against its torch reference, on CPU
under Triton's interpreter (started by test_fp8_swiglu_interpreted.py with TRITON_INTERPRET=1; skipped without it).
The interpreter has no libdevice, so its exp is numpy's, as the reference's is torch's here: the codes, both layouts
and the amaxes must agree to the bit. On a GPU the kernel (libdevice's exp) is compared with inductor's compiled
step (test_fused_swiglu_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from tests.interpreted import require_interpreter

pytest.importorskip("triton")
require_interpreter("test_fp8_swiglu_interpreted.py")

from training.precision import fp8_swiglu_triton as fs  # noqa: E402


def _operands(rows, cols, seed=0):
    """g over a wide range (silu's both tails), u and dL/dh with magnitudes 2^-30..2^12 so that, times the scales,
    the codes cover subnormals, normals and saturation; zeros and -0.0."""
    gen = torch.Generator().manual_seed(seed)

    def wide(lo, hi):
        return torch.randn(rows, cols, generator=gen) * torch.exp2(
            torch.randint(lo, hi, (rows, cols), generator=gen).float())

    g, u, dh = (torch.randn(rows, cols, generator=gen) * 6), wide(-20, 6), wide(-30, 0)
    g[0, :3], u[1, :3], dh[2, :3] = 0.0, -0.0, 0.0
    return g.bfloat16(), u.bfloat16(), dh.bfloat16()


def _codes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("rows,cols,tile", [(64, 256, {}), (70, 130, dict(bm=32, bn=64))])  # partial tiles
def test_forward_codes_in_both_layouts_and_the_amax_are_the_references(rows, cols, tile):
    g, u, _ = _operands(rows, cols)
    scale = torch.tensor(448.0 / 40.0)
    got = fs.swiglu_fp8_launch(g, u, None, scale, None, **tile)
    want = fs.swiglu_fp8_reference(g, u, None, scale)
    assert got[0].dtype == torch.float8_e4m3fn and got[1].shape == (cols, rows)
    assert torch.equal(_codes(got[0]), _codes(want[0])) and torch.equal(_codes(got[1]), _codes(want[1]))
    assert torch.equal(got[2], want[2]) and got[2] > 0
    assert (_codes(got[0]) & 0x7F == 0x7E).any()  # some saturate at 448
    # current scaling's first pass: the same amax from the kernel with its stores compiled out, and its reference
    assert torch.equal(fs.swiglu_fp8_launch(g, u, None, None, None, store=False, **tile), want[2])
    assert torch.equal(fs.swiglu_amax_reference(g, u), want[2])


@pytest.mark.parametrize("rows,cols,tile", [(64, 256, {}), (70, 130, dict(bm=32, bn=64))])
def test_backward_codes_in_both_layouts_and_the_amaxes_are_the_references(rows, cols, tile):
    g, u, dh = _operands(rows, cols, seed=1)
    s_g, s_u = torch.tensor(57344.0 / 2e-4), torch.tensor(57344.0 / 1e-4)
    got = fs.swiglu_fp8_launch(g, u, dh, s_g, s_u, **tile)
    want = fs.swiglu_fp8_reference(g, u, dh, s_g, s_u)
    for i, name in enumerate(("dg", "dgT", "amax_dg", "du", "duT", "amax_du")):
        if i % 3 == 2:
            assert torch.equal(got[i], want[i]) and got[i] > 0, name
        else:
            assert got[i].dtype == torch.float8_e5m2, name
            assert torch.equal(_codes(got[i]), _codes(want[i])), name
    assert not torch.equal(_codes(got[0]), _codes(got[3]))  # the two gradients are not mixed up
    amax_dg, amax_du = fs.swiglu_fp8_launch(g, u, dh, None, None, store=False, **tile)  # the amax-only pass
    assert torch.equal(amax_dg, want[2]) and torch.equal(amax_du, want[5])
    assert all(torch.equal(a, b) for a, b in zip(fs.swiglu_amax_reference(g, u, dh), (want[2], want[5])))
