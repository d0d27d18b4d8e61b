"""NVFP4's fused SwiGLU (training/precision/nvfp4_swiglu_triton.py) and the MLP function around it
(nvfp4.NVFP4SwiGLUMLPFn) on CPU under Triton's interpreter (started by test_nvfp4_swiglu_interpreted.py with
TRITON_INTERPRET=1; skipped without it). The interpreter has no libdevice, so its exp is numpy's, as the reference's
is torch's here. On a GPU the MLP function is compared with the three layers' compiled step, to the bit
(test_nvfp4_swiglu_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.interpreted import require_interpreter

pytest.importorskip("triton")
require_interpreter("test_nvfp4_swiglu_interpreted.py")

from training.precision import nvfp4_swiglu_triton as ns  # noqa: E402
from training.precision import nvfp4_triton as nt  # noqa: E402
from training.precision.formats import random_sign_vector, rht_matrix  # noqa: E402


def _same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _operands(rows, cols, seed=0):
    """GEMM results as the emulated GEMM gives them (BF16, magnitudes of products of FP4 values and E4M3 scales) and
    FP32 scales of per-tensor-scale products (~1e-4..1e-7): g times its scale over silu's both tails."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(rows, cols, generator=gen) * 4e4
    u = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-8, 8, (rows, cols), generator=gen).float())
    dh = torch.randn(rows, cols, generator=gen) * 3e3
    g[0, :3], u[1, :3], dh[2, :3] = 0.0, -0.0, 0.0
    scales = torch.tensor([1.7e-4]), torch.tensor([3.1e-3]), torch.tensor([2.3e-7])
    return g.bfloat16(), u.bfloat16(), dh.bfloat16(), scales


def _np_exp(t):
    """numpy's exp, the interpreter's tl.exp (torch's CPU exp can differ from it in the last bit)."""
    return torch.from_numpy(np.exp(t.numpy()))


def _rht_t():
    return nt.rht_operand(rht_matrix(random_sign_vector(0)), "cpu")


@pytest.mark.parametrize("rht", [True, False])
@pytest.mark.parametrize("rows,cols,tile", [(64, 256, {}), (48, 160, {}),  # 48: a masked last group; 160: columns
                                            (32, 96, dict(block_n=32, groups=1, num_warps=2))])
def test_forward_h_and_its_maxima_are_the_reference_and_the_amax_pass(rht, rows, cols, tile):
    g, u, _, (s_g, s_u, _) = _operands(rows, cols)
    h, amax = ns.swiglu_launch(g, u, None, s_g, s_u, None, _rht_t(), rht, **tile)
    assert _same_bits(h, ns.nvfp4_swiglu_reference(g, u, s_g, s_u, exp=_np_exp))
    assert amax.dtype == torch.float32 and amax.shape == (2,)
    assert torch.equal(amax[0], h.float().abs().max()) and amax[0] > 0
    if not rht:
        assert torch.equal(amax[1], amax[0])
    pass_amax = nt.amax_launch(h, _rht_t(), rht)
    assert torch.equal(amax[0], pass_amax[0])
    if tile and rht:
        # Under the interpreter tl.dot is numpy's matmul, whose summation order is OpenBLAS's kernel's for the
        # block's shape: a tile other than the amax pass's can move max|RHT(h)| by its last bit (OpenBLAS' Zen and
        # Haswell kernels on an AMD EPYC did; its SkylakeX kernels did not). The GPU test checks these bits across
        # tiles (test_nvfp4_swiglu_gpu.py); here, one FP32 ulp, and the quantize pass below gets the pass's maxima.
        assert torch.allclose(amax[1], pass_amax[1], rtol=2.0 ** -23, atol=0.0), (amax, pass_amax)
        amax = pass_amax
    else:
        assert torch.equal(amax[1], pass_amax[1])
    # The quantize pass from these maxima gives the bits of the quantizer with its own amax pass, both roundings.
    for stochastic in (False, True):
        seed = torch.tensor([11])
        want = nt.dual_quantize_launch(h, _rht_t(), seed, rht, stochastic)
        got = nt.quantize_launch(h, _rht_t(), amax, seed, rht, stochastic)
        assert _same_bits(got[0], want[0]) and _same_bits(got[1], want[1]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("rht", [True, False])
@pytest.mark.parametrize("rows,cols,tile", [(64, 256, {}), (48, 160, {})])
def test_backward_gradients_and_their_maxima_are_the_reference_and_the_amax_pass(rht, rows, cols, tile):
    g, u, dh, (s_g, s_u, s_dh) = _operands(rows, cols, seed=1)
    dg, du, amax = ns.swiglu_launch(g, u, dh, s_g, s_u, s_dh, _rht_t(), rht, **tile)
    want_dg, want_du = ns.nvfp4_swiglu_reference(g, u, s_g, s_u, dh, s_dh, exp=_np_exp)
    assert _same_bits(dg, want_dg) and _same_bits(du, want_du)
    assert not torch.equal(dg, du)  # not mixed up
    assert amax.shape == (4,)
    assert torch.equal(amax[0], dg.float().abs().max()) and torch.equal(amax[2], du.float().abs().max())
    for d, m in ((dg, amax[0:2]), (du, amax[2:4])):
        seed = torch.tensor([5])
        want = nt.dual_quantize_launch(d, _rht_t(), seed, rht, True)
        got = nt.quantize_launch(d, _rht_t(), m, seed, rht, True)
        assert _same_bits(got[0], want[0]) and _same_bits(got[1], want[1]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("backward", [False, True])
def test_the_transposed_rht_product_gives_the_same_outputs_and_plain_maxima(backward):
    """The RHT's product taken transposed (`transposed`, the quantize pass's wgmma form) changes nothing but how the
    RHT maxima are summed: the outputs and the plain maxima are the same; the RHT maxima agree to FP32 rounding here
    (numpy's sums in another order; on a GPU, bench/nvfp4_swiglu_probe.py checks them to the bit)."""
    g, u, dh, (s_g, s_u, s_dh) = _operands(32, 256, seed=2)
    args = (g, u, dh if backward else None, s_g, s_u, s_dh if backward else None, _rht_t(), True)
    plain, transposed = ns.swiglu_launch(*args), ns.swiglu_launch(*args, transposed=True)
    for a, b in zip(plain[:-1], transposed[:-1]):
        assert _same_bits(a, b)
    amax, amax_t = plain[-1], transposed[-1]
    assert torch.equal(amax[0::2], amax_t[0::2])
    assert torch.allclose(amax[1::2], amax_t[1::2], rtol=1e-6, atol=0)


def _mlp_inputs(seed=3, tokens=32, hidden=64, inter=96):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens // 2, hidden, generator=gen).bfloat16()
    wg, wu = ((torch.randn(inter, hidden, generator=gen) * 0.1).bfloat16() for _ in range(2))
    wd = (torch.randn(hidden, inter, generator=gen) * 0.1).bfloat16()
    dy = torch.randn(2, tokens // 2, hidden, generator=gen).bfloat16()
    return x, wg, wu, wd, dy


def _quantizers(stochastic=True, weight_2d=True):
    from training.precision.nvfp4 import NVFP4Quantizer

    return [NVFP4Quantizer(rht=True, stochastic_rounding=stochastic, weight_2d=weight_2d, rht_seed=0,
                           device=torch.device("cpu")) for _ in range(3)]


def _run_fn(x, wg, wu, wd, dy, qs, cached=(None,) * 12):
    from training.precision.nvfp4 import NVFP4SwiGLUMLPFn

    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    torch.manual_seed(9)  # the SR seeds come from torch's generator
    y = NVFP4SwiGLUMLPFn.apply(*leaves, *qs, *cached)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("weight_2d", [True, False])
def test_the_mlp_function_is_its_references_wired_alike(monkeypatch, weight_2d):
    """NVFP4SwiGLUMLPFn with the kernels against the same function with the SwiGLU pass's torch reference and the
    quantizer's own amax pass in their place: Y, dX and the three dW to the bit, stochastic rounding of the three
    dY on (the seeds drawn alike), 16x16 and 1x16 weight blocks."""
    from training.precision import nvfp4_swiglu_triton

    inputs = _mlp_inputs()
    got = _run_fn(*inputs, _quantizers(weight_2d=weight_2d))

    def fwd_ref(g, u, s_g, s_u, rht_t, *, rht):
        h = ns.nvfp4_swiglu_reference(g, u, s_g, s_u, exp=_np_exp)
        return h, None

    def bwd_ref(g, u, dh, s_g, s_u, s_dh, rht_t, *, rht):
        dg, du = ns.nvfp4_swiglu_reference(g, u, s_g, s_u, dh, s_dh, exp=_np_exp)
        return dg, None, du, None

    def quantize_own_amax(x, h, amax, *, rht, stochastic):
        assert amax is None
        return nt.nvfp4_dual_quantize(x, h, rht=rht, stochastic=stochastic)

    monkeypatch.setattr(nvfp4_swiglu_triton, "nvfp4_swiglu_fwd", fwd_ref)
    monkeypatch.setattr(nvfp4_swiglu_triton, "nvfp4_swiglu_bwd", bwd_ref)
    monkeypatch.setattr(nt, "nvfp4_dual_quantize_given_amax", quantize_own_amax)
    want = _run_fn(*inputs, _quantizers(weight_2d=weight_2d))
    for name, a, b in zip(("Y", "dX", "dWgate", "dWup", "dWdown"), got, want):
        assert _same_bits(a, b), name


def test_the_mlp_function_is_the_three_layers_up_to_their_bf16_roundings():
    """Against gate and up (NVFP4SharedInputFn), silu * up and down (NVFP4FusedFn), run eagerly as autograd runs
    them (each GEMM's scaled result rounded to BF16 before the SwiGLU, which the fused pass, like inductor, does not):
    the same operands, layouts and weight caches, so Y, dX and every dW agree to well within FP4's error (round to
    nearest; the cached operands of the per-step weight cache for up and down)."""
    from training.precision.nvfp4 import NVFP4FusedFn, NVFP4SharedInputFn

    x, wg, wu, wd, dy = _mlp_inputs(seed=4)
    qs = _quantizers(stochastic=False)
    cached = []
    for i, w in enumerate((wg, wu, wd)):
        f = qs[i].weight_fprop(w, dtype=torch.bfloat16)
        cached += [None] * 4 if i == 0 else [f.values, f.outer, f.t().values, f.t().outer]
    got = _run_fn(x, wg, wu, wd, dy, qs, tuple(cached))
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    gate, up = NVFP4SharedInputFn.apply(leaves[0], leaves[1], None, leaves[2], None, qs[0], qs[1])
    y = NVFP4FusedFn.apply(torch.nn.functional.silu(gate) * up, leaves[3], None, qs[2])
    y.backward(dy)
    for name, a, b in zip(("Y", "dX", "dWgate", "dWup", "dWdown"), got, [y] + [t.grad for t in leaves]):
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        assert 0 < rel < 0.05, (name, rel)


def test_a_converted_llama_runs_its_mlps_fused_with_the_option_and_the_layers_path_without(monkeypatch):
    """apply_recipe("nvfp4") on a tiny Llama (BF16): every block's MLP runs NVFP4SwiGLUMLPFn on the fused path (forced
    on here, the kernels interpreted on CPU), with a hook on a layer (the numerics probe) the layers' path; with
    fused_swiglu false gate and up share their input's quantization as before. Eagerly the layers' path rounds each
    GEMM's scaled result to BF16 before the SwiGLU and the fused pass does not, so FP4 roundings flip between the two:
    every gradient of the fused model is as far from the unquantized model's as the layers' path's is (within 15 %),
    and nearer to the layers' path's than either is to the unquantized one."""
    from training.model import build_model, llama_config
    from training.precision import apply_recipe
    from training.precision.nvfp4 import NVFP4EmulatedLinear, NVFP4SharedInputFn, NVFP4SwiGLUMLPFn

    monkeypatch.setattr(NVFP4EmulatedLinear, "_fused_path", lambda self, x: True)
    calls = {"fused": 0, "shared": 0}
    fused, shared = NVFP4SwiGLUMLPFn.apply, NVFP4SharedInputFn.apply
    monkeypatch.setattr(NVFP4SwiGLUMLPFn, "apply", lambda *a: calls.__setitem__("fused", calls["fused"] + 1)
                        or fused(*a))
    monkeypatch.setattr(NVFP4SharedInputFn, "apply", lambda *a: calls.__setitem__("shared", calls["shared"] + 1)
                        or shared(*a))
    cfg = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2}  # one block: the interpreter's time is per quantized layer
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    runs = []
    for option in (True, False, None):  # None: no recipe, the unquantized BF16 model
        model = build_model(llama_config(cfg, 256, 32), 0).bfloat16()
        if option is not None:
            report = apply_recipe(model, "nvfp4", fused_swiglu=option, stochastic_rounding=False)
            assert any("fused_swiglu" in note for note in report.notes)
            assert all(getattr(layer.mlp, "_plab_fused_swiglu", False) is option for layer in model.model.layers)
        calls.update(fused=0, shared=0)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        want = {None: {"fused": 0, "shared": 0}, True: {"fused": 1, "shared": 0}, False: {"fused": 0, "shared": 1}}
        assert calls == want[option], (option, calls)
        runs.append([loss.detach()] + [p.grad for p in model.parameters()])
        if option:  # a hook on a layer: the layers' path, with the shared input
            handle = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *a: None)
            calls.update(fused=0, shared=0)
            with torch.no_grad():
                model(input_ids=ids)
            assert calls == {"fused": 0, "shared": 1}, calls  # the one block's MLP: the layers' path
            handle.remove()

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    fused_run, layers_run, bf16_run = runs
    assert abs(float(fused_run[0]) - float(layers_run[0])) < 0.02
    for i, (f, lay, ref) in enumerate(zip(fused_run[1:], layers_run[1:], bf16_run[1:])):
        assert rel(f, ref) < 1.15 * rel(lay, ref), (i, rel(f, ref), rel(lay, ref))
        assert rel(f, lay) < min(rel(f, ref), rel(lay, ref)), (i, rel(f, lay), rel(f, ref), rel(lay, ref))
