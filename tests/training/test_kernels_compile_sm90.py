"""The FSDP2 shard update's kernel as the GPU compiler builds it for sm_90 (Hopper), on this CPU machine: the
arithmetic that gives torch's fused AdamW's bits (training/optim_kernels.py) must reach the PTX as explicit FMAs,
IEEE divisions and square roots. (Every kernel the interpreter checks launch is also compiled for sm_90 by
tests/interpreted.py; this looks at the instructions.)"""
from __future__ import annotations

import itertools

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from training import optim_kernels as ok  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


def _compile(fn, signature: dict, constexprs: dict):
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=SM90,
                         options={"num_warps": ok.SHARD_NUM_WARPS, "enable_fp_fusion": False})
    assert out.asm.get("cubin"), "no cubin"
    return out


@pytest.mark.parametrize("scale,decay", list(itertools.product([True, False], repeat=2)))
@pytest.mark.parametrize("bf16_grads_and_outs", [False, True])  # FSDP2's one-rank direct step reads and writes BF16
def test_shard_adamw_kernel_compiles_for_sm90(scale, decay, bf16_grads_and_outs):
    sig = {"table_ptr": "*i64", "n_params": "i32", "step_size_ptr": "*fp32", "bc2s_ptr": "*fp32",
           "grad_scale_ptr": "*fp32", "lr_wd": "fp32", "beta1": "fp32", "one_minus_beta1": "fp32", "beta2": "fp32",
           "one_minus_beta2": "fp32", "eps": "fp32"}
    out = _compile(ok._adamw_shard_kernel, sig, {"HAS_SCALE": scale, "HAS_DECAY": decay, "BLOCK": ok.SHARD_BLOCK,
                                                 "G_BF16": bf16_grads_and_outs, "HAS_OUT": bf16_grads_and_outs,
                                                 "P": 8})
    # the FP32 arithmetic torch's kernel makes: explicit FMAs, IEEE division and square root, nothing fused else
    ptx = out.asm["ptx"]
    assert "fma.rn.f32" in ptx and "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx
