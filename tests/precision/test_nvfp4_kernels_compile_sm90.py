"""The fused NVFP4 quantize kernel as the GPU compiler builds it for sm_90 (Hopper), on this CPU machine, with the
divisibility the launcher gives a GPU launch (16-byte aligned pointers, sizes multiples of 16): the instructions the
kernel's speed rests on (bench/NOTES_floor.md 42) must be there. The interpreter checks (test_nvfp4_triton_
interpreted.py) run the other branch of the helpers these select between, and compare the values."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from training.precision import nvfp4_triton as nt  # noqa: E402

SIGNATURE = {"x_ptr": "*bf16", "h_ptr": "*bf16", "amax_ptr": "*fp32", "seed_ptr": "*i64", "a_ptr": "*bf16",
             "b_ptr": "*bf16", "pts_ptr": "*fp32", "M": "i32", "N": "i32", "stride_m": "i32"}
ALIGNED = ("x_ptr", "h_ptr", "a_ptr", "b_ptr", "M", "N", "stride_m")


def _ptx(stochastic: bool) -> str:
    cfg = nt.launch_config(8192, stochastic)
    constexprs = dict(BLOCK=cfg["block_n"], GROUPS=cfg["groups"], HAS_RHT=True, STOCH=stochastic, DOT_BF16=True,
                      CUDA_SEMANTICS=True)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(SIGNATURE) if name in ALIGNED}
    src = ASTSource(fn=nt._nvfp4_dual_quant_kernel, signature={**SIGNATURE, **{k: "constexpr" for k in constexprs}},
                    constexprs=constexprs, attrs=attrs)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})
    assert out.asm.get("cubin"), "no cubin"
    return out.asm["ptx"]


@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_kernel_compiles_to_the_instructions_its_speed_rests_on(stochastic):
    ptx = _ptx(stochastic)
    # The Wgrad operand's transform as one Hopper warpgroup product per tile ((BLOCK_N, 16) = x^T @ rht).
    assert "wgmma.mma_async" in ptx
    # The block scales' IEEE divisions (bit-exact with torch), never the approximate one.
    assert "div.rn.f32" in ptx and "div.full.f32" not in ptx and "div.approx.f32" not in ptx
    # Stochastic rounding with one FMA rounded toward zero per element and output; none in round-to-nearest.
    assert ("fma.rz.f32" in ptx) == stochastic
    # The tile is read and both outputs written with 16-byte vectors along the features.
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
