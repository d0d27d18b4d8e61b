"""GPU only (SM89+, skipped elsewhere): fp8_delayed's `amax_by_rows` and `transpose_from_codes` change how the
compiled step computes the amax and the transposed FP8 layouts, not what they are: the layer with either or both
gives the default layer's Y, dX, dW, amax history and scales bit for bit, eagerly and compiled (inductor's default
mode and CUDA graphs), step after step (just-in-time scales first, then the history's)."""
import copy

import pytest
import torch
import torch.nn as nn

from training.precision.fp8_delayed import DelayedScalingLinear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an SM89+ GPU (FP8 GEMMs)")

VARIANTS = {"rows": dict(amax_by_rows=True), "from_codes": dict(transpose_from_codes=True),
            "both": dict(amax_by_rows=True, transpose_from_codes=True)}


@pytest.mark.parametrize("mode", ["eager", None, "reduce-overhead"], ids=["eager", "compiled", "cuda_graphs"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_variant_trains_bit_for_bit_like_the_default(variant, mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = DelayedScalingLinear(nn.Linear(256, 512, bias=False), history_len=4, real=True).to("cuda", torch.bfloat16)
    other = copy.deepcopy(base)
    for key, value in VARIANTS[variant].items():
        setattr(other, key, value)
    run = [base, other] if mode == "eager" else [torch.compile(m, mode=mode) for m in (base, other)]
    for step in range(5):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16) * (1 + step)
        outs = []
        for mod, owner in zip(run, (base, other)):
            owner.weight.grad = None
            xi = x.clone().requires_grad_()
            y = mod(xi)
            (y.float().square().sum()).backward()
            outs.append((y.detach().clone(), xi.grad, owner.weight.grad))
            owner.update_scales()
        for name, want, got in zip(("y", "dx", "dw"), *outs):
            assert got.abs().sum() > 0, f"step {step}: {name} is zero"
            assert torch.equal(got, want), f"step {step}: {name} differs"
        assert torch.equal(other.amax_history, base.amax_history), f"step {step}"
        assert torch.equal(other.scales, base.scales), f"step {step}"
