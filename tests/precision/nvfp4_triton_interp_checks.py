"""The fused NVFP4 Triton quantizers (training/precision/nvfp4_triton.py) against the torch quantizers of
formats.py (themselves bit-exact with torchao), on CPU under Triton's interpreter. The interpreter must be
on before triton is first imported, so test_nvfp4_triton_interpreted.py runs this file in a subprocess
with TRITON_INTERPRET=1; collected directly without it, it skips. The GPU run of the same comparison is
bench/nvfp4_kernel_bench.py."""
from __future__ import annotations

import pytest
import torch

from tests.interpreted import require_interpreter

pytest.importorskip("triton")

from training.precision.formats import (quantize_nvfp4, random_hadamard_transform, random_sign_vector,  # noqa: E402
                                        rht_matrix)


require_interpreter("test_nvfp4_triton_interpreted.py")


@pytest.fixture(scope="module")
def nt():
    from training.precision import nvfp4_triton
    return nvfp4_triton


def _operand(rows, cols, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(rows, cols, generator=g)
    elif kind == "heavy":  # Student-t-like tails plus a few x1e4 outliers, per-row magnitudes
        x = torch.randn(rows, cols, generator=g) / torch.rand(rows, cols, generator=g).clamp_min(0.02).sqrt()
        x.view(-1)[torch.randint(0, x.numel(), (5,), generator=g)] *= 1e4
    elif kind == "tiny":
        x = torch.randn(rows, cols, generator=g) * 1e-30
    elif kind == "ties":  # every block's scale is 1 and its values sit on E2M1's rounding ties (and grid points)
        grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 3.0, 4.0, 0.0, 0.1, 2.2, 4.9, 5.5])
        x = grid[torch.randint(0, len(grid), (rows, cols), generator=g)]
        x = x * torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
        x[:, ::16] = 6.0  # each block along the features holds 6: block scale 6 / 6 = 1
        x[::16, :] = 6.0  # and each block along the tokens
        x[0, 0] = 2688.0  # the global amax: per-tensor scale 2688 / (448 * 6) = 1
        return x.bfloat16()
    x = x * torch.exp(torch.randn(rows, 1, generator=g))
    x[1, :16] = 0  # an all-zero block along the features
    x[16:32, 5] = 0  # an all-zero block along the tokens
    return x.bfloat16()


def _same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("kind", ["normal", "heavy", "tiny", "ties"])
@pytest.mark.parametrize("cols,config", [(96, {}), (160, {}),  # 160: a partial BLOCK_N tile (masked columns)
                                         (160, dict(block_n=64, groups=1, num_warps=2)),
                                         (96, dict(block_n=32, groups=2, num_warps=8))])
def test_both_outputs_are_bit_exact_with_the_torch_quantizers(nt, kind, cols, config):
    x = _operand(48, cols, kind)  # 48 tokens: with 4 groups of 16 per program, a partial row block
    m = rht_matrix(random_sign_vector(0))
    seed = torch.zeros(1, dtype=torch.int64)
    a, b, pts = nt.dual_quantize_launch(x, nt.rht_operand(m, "cpu"), seed, True, False, **config)
    ref_a = quantize_nvfp4(x, dtype=torch.bfloat16)
    assert _same_bits(a, ref_a.values) and torch.equal(pts[0], ref_a.outer)
    # Wgrad operand: RHT along the tokens in FP32 (the CPU path's arithmetic), 1x16 blocks along the tokens.
    ref_b = quantize_nvfp4(random_hadamard_transform(x, m, axis=0), axis=0, dtype=torch.bfloat16)
    assert _same_bits(b, ref_b.values) and torch.equal(pts[1], ref_b.outer)
    # Without the transform: the plain token-blocked quantization.
    _, b_plain, _ = nt.dual_quantize_launch(x, nt.rht_operand(m, "cpu"), seed, False, False)
    assert _same_bits(b_plain, quantize_nvfp4(x, axis=0, dtype=torch.bfloat16).values)


def test_an_all_zero_operand_gives_zeros_not_nan(nt):
    x = torch.zeros(32, 32, dtype=torch.bfloat16)
    a, b, pts = nt.dual_quantize_launch(x, nt.rht_operand(rht_matrix(random_sign_vector(0)), "cpu"),
                                        torch.zeros(1, dtype=torch.int64), True, True)
    assert not a.any() and not b.any() and not pts.any()


def test_stochastic_rounding_lands_on_the_two_neighbours_and_is_unbiased(nt):
    x = _operand(16, 32, "normal", seed=3)
    h = nt.rht_operand(rht_matrix(random_sign_vector(0)), "cpu")
    rne, _, pts = nt.dual_quantize_launch(x, h, torch.zeros(1, dtype=torch.int64), False, False)
    draws = torch.stack([nt.dual_quantize_launch(x, h, torch.tensor([s]), False, True)[0].float()
                         for s in range(160)])
    assert not torch.equal(draws[0], draws[1]), "different seeds must draw different roundings"
    target = x.float() / pts[0]  # the value before rounding, in units of the per-tensor scale
    lo, hi = draws.min(0).values, draws.max(0).values
    # at most two values per element, each within one grid step of the unrounded value (the E2M1 grid
    # times the block scale, ~ block amax / 6, up to E4M3's 2^-4 rounding), one of them the RNE result
    assert bool(((draws == lo) | (draws == hi)).all())
    block_scale = (x.float().abs().reshape(16, 2, 16).amax(-1, keepdim=True) / pts[0] / 6).expand(16, 2, 16)
    a = 1.07 * target.abs() / block_scale.reshape(16, 32)  # near a step change, the coarser step
    grid_step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)) * block_scale.reshape(16, 32)
    assert bool(((draws - target).abs() <= 1.07 * grid_step + 1e-6).all())
    assert bool(((rne.float() == lo) | (rne.float() == hi)).all())
    bias_sr = (draws.mean(0) - target).abs().mean()
    err_rne = (rne.float() - target).abs().mean()
    assert bias_sr < 0.35 * err_rne, (float(bias_sr), float(err_rne))


@pytest.mark.parametrize("weight_2d", [True, False])
def test_fused_autograd_function_matches_the_torch_path(nt, weight_2d):
    """NVFP4FusedFn (the CUDA fast path's autograd wiring: which operand, which layout, the saved Wgrad operand
    and tile-quantized weight) against EmulatedLinearFn with the same quantizer, RNE so both are deterministic.
    The fused path's GEMMs take BF16 values (as on the GPU), the torch path's FP32 ones: equal up to BF16
    rounding of the products' sums."""
    from training.precision.emulation import EmulatedLinearFn
    from training.precision.nvfp4 import NVFP4FusedFn, NVFP4Quantizer

    q = NVFP4Quantizer(rht=True, stochastic_rounding=False, weight_2d=weight_2d, rht_seed=0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 32, 64, generator=g).bfloat16()
    w = (torch.randn(48, 64, generator=g) * 0.1).bfloat16()
    dy = torch.randn(2, 32, 48, generator=g).bfloat16()
    outs = []
    for fn in (NVFP4FusedFn, EmulatedLinearFn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn.apply(xi, wi, None, q)
        y.backward(dy)
        outs.append((y.float(), xi.grad.float(), wi.grad.float()))
    for what, a, b in zip(("Y", "dX", "dW"), *outs):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-2, (what, rel)


def test_the_gemm_benchmarks_fused_quantizers_are_the_training_steps(nt, monkeypatch):
    """The GEMM benchmark's "with quantization" mode on CUDA (forced on here, the kernels interpreted on CPU):
    X and dY through the fused kernel exactly as NVFP4FusedFn calls it (dY with stochastic rounding), both
    layouts from one pass, and one weight tile quantization serving Fprop and Dgrad."""
    from training.precision.nvfp4 import NVFP4EmulatedGemmOps
    from training.precision.registry import get_recipe

    monkeypatch.setattr(NVFP4EmulatedGemmOps, "_fused", lambda self: True)
    ops = get_recipe("nvfp4").gemm_ops(torch.device("cpu"))
    q = ops.training
    x = _operand(48, 96, "normal")
    for role, stochastic in (("input", False), ("grad_output", True)):
        torch.manual_seed(0)  # the kernel's Philox seed is drawn from torch's generator
        row, t = ops.quantizer(role)(x, ("row", "t"))
        torch.manual_seed(0)
        a, b, pts = nt.nvfp4_dual_quantize(x, q.rht_operand("cpu"), rht=q.rht, stochastic=stochastic)
        assert _same_bits(row.values, a) and torch.equal(row.outer, pts[0])
        assert _same_bits(t.values, b.t()) and torch.equal(t.outer, pts[1])
    w = _operand(64, 96, "normal")
    w_row, w_t = ops.quantizer("weight")(w, ("row", "t"))
    assert w_t.values.data_ptr() == w_row.values.data_ptr()
    assert torch.equal(w_row.dequantize(), q.weight_fprop(w, dtype=torch.bfloat16).dequantize())


def test_stochastic_rounding_draws_independently_per_element_and_output(nt):
    """Every element of both outputs gets its own random number: each block holds a 6 (block scale 1, per-tensor
    scale 6 / 2688, so the other elements keep their value, 1.296875 in BF16, between the grid points 1 and
    1.5); over many seeds no two columns, no two rows, and not `a` and `b`, round alike, and each rounds up
    about as often as its distance says (0.59)."""
    x = torch.full((32, 128), 1.3, dtype=torch.bfloat16)
    x[:, ::16] = 6.0  # each block along the features holds the maximum
    x[::16, :] = 6.0  # and each block along the tokens
    h = nt.rht_operand(rht_matrix(random_sign_vector(0)), "cpu")
    keep_rows = torch.tensor([r % 16 != 0 for r in range(32)])
    keep_cols = torch.tensor([c % 16 != 0 for c in range(128)])
    ups_a, ups_b = [], []
    for s in range(48):
        a, b, _ = nt.dual_quantize_launch(x, h, torch.tensor([s]), False, True, block_n=128, groups=1)
        # the outputs are element x block scale (the per-tensor scale apart): a 6 marks the block scale
        ups_a.append((a.float() > a.float()[0, 0] * 1.25 / 6)[keep_rows][:, keep_cols])
        ups_b.append((b.float() > b.float()[0, 0] * 1.25 / 6)[keep_rows][:, keep_cols])
    ua, ub = torch.stack(ups_a), torch.stack(ups_b)
    for u in (ua, ub):
        cols = u.permute(2, 0, 1).reshape(u.shape[2], -1)
        rows = u.permute(1, 0, 2).reshape(u.shape[1], -1)
        assert len({tuple(c.tolist()) for c in cols}) == len(cols)
        assert len({tuple(r.tolist()) for r in rows}) == len(rows)
        assert 0.55 < u.float().mean() < 0.64, float(u.float().mean())
    assert not torch.equal(ua, ub)
