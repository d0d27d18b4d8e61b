"""GPU only (SM89+, skipped elsewhere): fp8_tensorwise's `implementation: plab` (CurrentScalingLinear) against torchao's
tensorwise Float8Linear on the GPU's FP8 GEMMs. One layer: Y, dX, dW and db equal to the bit, eagerly and compiled by
inductor, over steps whose X, W and dY amaxes change. A small Llama, eagerly: the first loss and every gradient equal
to the bit (the operands each layer casts are the same BF16 tensors). Compiled, inductor fuses each cast into the
kernel that produces its operand differently in the two graphs, so the model is held to the FP8 error only; the first
losses are printed for the record."""
import copy

import pytest
import torch
import torch.nn as nn

from training.model import build_model, llama_config
from training.precision import apply_recipe
from training.precision.fp8_tensorwise import CurrentScalingLinear
from training.precision.registry import get_recipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an SM89+ GPU (FP8 GEMMs)")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_the_plab_layer_gives_torchaos_every_bit_on_the_gpu(bias, compiled):
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = nn.Linear(256, 512, bias=bias).to("cuda", torch.bfloat16)
    results = []
    for implementation in ("torchao", "plab"):
        layer = copy.deepcopy(lin)
        module, _, how = get_recipe("fp8_tensorwise").convert(layer, "proj", {"implementation": implementation},
                                                              True)
        assert isinstance(module, CurrentScalingLinear) == (implementation == "plab"), how
        run = torch.compile(module) if compiled else module
        steps = []
        for step in range(3):
            g = torch.Generator(device="cuda").manual_seed(step)
            x = (torch.randn(128, 256, device="cuda", generator=g) * (1 + 3 * step)).to(torch.bfloat16)
            dy = (torch.randn(128, 512, device="cuda", generator=g) * 10 ** -step).to(torch.bfloat16)
            layer.weight.grad = None
            if bias:
                layer.bias.grad = None
            xi = x.requires_grad_()
            y = run(xi)
            y.backward(dy)
            steps.append((y.detach(), xi.grad, layer.weight.grad) + ((layer.bias.grad,) if bias else ()))
            with torch.no_grad():
                layer.weight.mul_(1.5)
        results.append(steps)
    for step, (want, got) in enumerate(zip(*results)):
        for what, a, b in zip(("Y", "dX", "dW", "db"), want, got):
            assert a.abs().sum() > 0, (step, what)
            assert torch.equal(a, b), (step, what, (a.float() - b.float()).abs().max().item())


def _model_step(implementation: str, compiled: bool, ids):
    model = build_model(llama_config("tiny", 256, 64), 0).to("cuda", torch.bfloat16)
    report = apply_recipe(model, "fp8_tensorwise", backend="real", implementation=implementation)
    assert report.gemm_backend == "real", report.to_dict()
    run = torch.compile(model) if compiled else model
    loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return loss.detach(), grads


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_small_llama_gets_torchaos_loss_and_gradients(compiled):
    torch._dynamo.reset()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1)).to("cuda")
    (loss_a, grads_a), (loss_b, grads_b) = (_model_step(impl, compiled, ids) for impl in ("torchao", "plab"))
    print(f"first loss, {'compiled' if compiled else 'eager'}: torchao {loss_a.item():.7f}, plab {loss_b.item():.7f}")
    assert len(grads_a) == len(grads_b) > 0
    if not compiled:
        assert torch.equal(loss_a, loss_b)
        for i, (a, b) in enumerate(zip(grads_a, grads_b)):
            assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())
        return
    assert abs(loss_a.item() - loss_b.item()) < 2e-3 * loss_a.item()
    for i, (a, b) in enumerate(zip(grads_a, grads_b)):
        rel = ((a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-30)).item()
        assert rel < 0.05, (i, rel)  # FP8's own error (E5M2 dY ~ 0.07 per element), not a different recipe
