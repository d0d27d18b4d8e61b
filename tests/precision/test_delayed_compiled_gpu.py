"""GPU only (SM89+, skipped elsewhere): fp8_delayed's layer compiled by inductor, as training compiles it, gives the
eager layer's output and gradients step after step: the just-in-time scales of step 0, the recompilation when the
history is ready, and the history's scales after it (real FP8 GEMMs and the emulated path), with inductor's default
mode and under CUDA graphs (mode reduce-overhead: dY's amax leaves the backward through a token's gradient)."""
import copy

import pytest
import torch
import torch.nn as nn

from training.precision.fp8_delayed import DelayedScalingLinear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an SM89+ GPU (FP8 GEMMs)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "cuda_graphs"])
@pytest.mark.parametrize("real", [True, False])
def test_the_compiled_layer_trains_like_the_eager_one(real, mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = DelayedScalingLinear(nn.Linear(256, 512, bias=False), history_len=4, real=real).to("cuda",
                                                                                              torch.bfloat16)
    layer = copy.deepcopy(eager)
    compiled = torch.compile(layer, mode=mode)
    for step in range(6):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # as the training loop does under this mode
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) * (1 + step)
        outs = []
        for mod, owner in ((eager, eager), (compiled, layer)):
            owner.weight.grad = None
            xi = x.clone().requires_grad_()
            y = mod(xi)
            (y.float().square().sum()).backward()
            outs.append((y.detach(), xi.grad, owner.weight.grad))
            owner.update_scales()
        (y_e, dx_e, dw_e), (y_c, dx_c, dw_c) = outs
        assert dx_c.abs().sum() > 0 and dw_c.abs().sum() > 0, f"step {step}: zero gradients"
        for name, got, want in (("y", y_c, y_e), ("dx", dx_c, dx_e), ("dw", dw_c, dw_e)):
            assert _rel(got, want) < 2e-2, f"step {step}: {name} differs by {_rel(got, want):.3g}"
        assert torch.equal(eager.scales, layer.scales), f"step {step}"
        assert torch.equal(eager.amax_history, layer.amax_history), f"step {step}"
