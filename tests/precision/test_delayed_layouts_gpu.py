"""GPU only (SM89+, skipped elsewhere): fp8_delayed's `one_pass_cast` changes how the compiled step computes the
amax and the transposed FP8 layouts, not what they are: the layer with it gives the layer without it Y, dX, dW, amax
history and scales bit for bit, eagerly and compiled (inductor's default mode and CUDA graphs), step after step
(just-in-time scales first, then the history's)."""
import copy

import pytest
import torch
import torch.nn as nn

from training.precision.fp8_delayed import DelayedScalingLinear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an SM89+ GPU (FP8 GEMMs)")

@pytest.mark.parametrize("mode", ["eager", None, "reduce-overhead"], ids=["eager", "compiled", "cuda_graphs"])
def test_one_pass_cast_trains_bit_for_bit_like_the_casts_without_it(mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = DelayedScalingLinear(nn.Linear(256, 512, bias=False), history_len=4, real=True,
                                one_pass_cast=False).to("cuda", torch.bfloat16)
    other = copy.deepcopy(base)
    other.one_pass_cast = True
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
