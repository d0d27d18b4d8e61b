"""GPU only (skipped elsewhere): NVFP4's fused SwiGLU MLP (`fused_swiglu`, nvfp4.NVFP4SwiGLUMLPFn) gives, in a compiled
step, the bits of the three layers' path, whose SwiGLU and scale products inductor fuses: the kernel's math is
inductor's, and the maxima it reduces give the quantizer's own amax pass's scales (bench/NOTES_floor.md 86)."""
from __future__ import annotations

import pytest
import torch

from bench.first_compile_probe import build, compiled_step, differences, step
from training.precision.nvfp4 import FLEXIBLE_USER_KERNELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fused NVFP4 path)")


@pytest.mark.parametrize("settings", [FLEXIBLE_USER_KERNELS, {}], ids=["recipe_setting", "inductor_default"])
def test_the_fused_mlp_gives_the_three_layers_compiled_bits(settings):
    ids = torch.randint(0, 512, (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs = {}
    for fused in (False, True):
        model = build("nvfp4", 2, "cuda", fused_swiglu=fused)
        assert all(getattr(layer.mlp, "_plab_fused_swiglu", False) is fused for layer in model.model.layers)
        step(model, model, ids)  # an eager step first, as the training loop's values after it (test_nvfp4_layout_gpu)
        runs[fused] = compiled_step(model, ids, settings)
    (want, code_layers), (got, code_fused) = runs[False], runs[True]
    assert "_nvfp4_swiglu_kernel" in code_fused and "_nvfp4_swiglu_kernel" not in code_layers
    # the fused MLP skips the amax passes over h, dL/dgate and dL/dup
    assert code_layers.count("_nvfp4_dual_amax_kernel") > code_fused.count("_nvfp4_dual_amax_kernel")
    assert want[1].abs().sum() > 0
    assert not differences(want, got), differences(want, got)


def test_the_kernel_gives_inductors_values_and_the_amax_passes_maxima():
    from training.precision.formats import random_sign_vector, rht_matrix
    from training.precision.nvfp4_swiglu_triton import nvfp4_swiglu_bwd, nvfp4_swiglu_fwd
    from training.precision.nvfp4_triton import dual_quantize_launch, quantize_launch, rht_operand

    gen = torch.Generator("cuda").manual_seed(3)
    g, u, dh = (torch.randn(512, 768, device="cuda", generator=gen) * s for s in (4e4, 30.0, 3e3))
    g, u, dh = (t.bfloat16() for t in (g, u, dh))
    s_g, s_u, s_dh = (torch.tensor([v], device="cuda") for v in (1.7e-4, 3.1e-3, 2.3e-7))

    @torch.compile
    def inductor(g, u, dh, s_g, s_u, s_dh):  # the layers' path as the compiled step traces it
        gf, uf = g.float() * s_g, u.float() * s_u
        gs, us = gf.to(torch.bfloat16), uf.to(torch.bfloat16)  # emulated_mm's rounding, which inductor drops
        h = torch.nn.functional.silu(gs) * us
        dgs = (dh.float() * s_dh).to(torch.bfloat16)
        dg = torch.ops.aten.silu_backward(dgs * us, gs)
        return h, dg, dgs * torch.nn.functional.silu(gs)

    h_want, dg_want, du_want = inductor(g, u, dh, s_g, s_u, s_dh)
    rht_t = rht_operand(rht_matrix(random_sign_vector(0)), "cuda")
    h, amax_h = nvfp4_swiglu_fwd(g, u, s_g, s_u, rht_t, rht=True)
    dg, amax_dg, du, amax_du = nvfp4_swiglu_bwd(g, u, dh, s_g, s_u, s_dh, rht_t, rht=True)
    for name, a, b in (("h", h, h_want), ("dg", dg, dg_want), ("du", du, du_want)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (name, int((a != b).sum()))
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    for name, v, amax in (("h", h, amax_h), ("dg", dg, amax_dg), ("du", du, amax_du)):
        assert torch.equal(amax[0], v.float().abs().max()), name
        # the quantize pass from these maxima gives the quantizer's bits with its own amax pass (and scales)
        own = dual_quantize_launch(v, rht_t, zero, True, False)
        given = quantize_launch(v, rht_t, amax.contiguous(), zero, True, False)
        assert all(torch.equal(a, b) for a, b in zip(own, given)), name
