"""Shared by the CPU and GPU tests of fp8_tensorwise's `implementation: plab` against torchao's Float8Linear."""
import copy

import torch

from training.precision.fp8_tensorwise import CurrentScalingLinear
from training.precision.registry import get_recipe


def train_both_implementations(lin: torch.nn.Linear, x_shape: tuple, compile_fn=None, steps: int = 3) -> list:
    """[torchao's steps, plab's steps]: each a list of (Y, dX, dW[, db]) per step for a copy of `lin` converted to
    fp8_tensorwise's real path with that implementation (compiled by `compile_fn` if given). The steps change the
    X, W and dY amaxes: X grows, dY shrinks by 10x, W is scaled by 1.5 after each step."""
    device, dtype = lin.weight.device, lin.weight.dtype
    bias = lin.bias is not None
    results = []
    for implementation in ("torchao", "plab"):
        layer = copy.deepcopy(lin)
        module, _, how = get_recipe("fp8_tensorwise").convert(layer, "proj", {"implementation": implementation},
                                                              True)
        assert isinstance(module, CurrentScalingLinear) == (implementation == "plab"), how
        run = compile_fn(module) if compile_fn else module
        out = []
        for step in range(steps):
            g = torch.Generator(device=device).manual_seed(step)
            x = (torch.randn(x_shape, device=device, generator=g) * (1 + 3 * step)).to(dtype).requires_grad_()
            dy = (torch.randn(*x_shape[:-1], lin.out_features, device=device, generator=g)
                  * 10 ** -step).to(dtype)
            layer.weight.grad = None
            if bias:
                layer.bias.grad = None
            y = run(x)
            y.backward(dy)
            out.append((y.detach(), x.grad, layer.weight.grad) + ((layer.bias.grad,) if bias else ()))
            with torch.no_grad():
                layer.weight.mul_(1.5)  # the next step's W amax differs too
        results.append(out)
    return results
