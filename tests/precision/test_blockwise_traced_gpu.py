"""GPU only (SM90+, skipped elsewhere): fp8_blockwise's `TracedBlockwiseFn` must give torchao's fp8_blockwise_mm
results bit for bit (same kernels, the GEMM through torchao's custom op instead of F.scaled_mm) and compile into
one graph with its backward (no graph break: what made the recipe's layers run eagerly)."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs an SM90+ GPU (torchao's blockwise FP8 kernels)")


@pytest.fixture(autouse=True, scope="module")
def _autotune_policy():
    from training.precision.fp8_blockwise import apply_autotune_policy
    apply_autotune_policy()  # PLAB_BLOCKWISE_AUTOTUNE=quick: minutes less of torchao's quantizer autotuning


def _operands(tokens=512, k=1024, n=768):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, tokens // 2, k, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16().requires_grad_()
    dy = torch.randn(2, tokens // 2, n, device="cuda", generator=g).bfloat16()
    return x, w, dy


def _run(fn, x, w, dy):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y, x.grad, w.grad


def test_traced_function_equals_torchaos_fp8_blockwise_mm_bit_for_bit():
    from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

    from training.precision.fp8_blockwise import TracedBlockwiseFn
    x, w, dy = _operands()
    ours = _run(TracedBlockwiseFn.apply, x, w, dy)
    ref = _run(lambda a, b: fp8_blockwise_mm.apply(a, b, 128, torch.bfloat16, False), x, w, dy)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and torch.equal(a, b)
    assert ours[2].abs().sum() > 0


def test_traced_function_compiles_with_its_backward_in_one_graph():
    from training.precision.fp8_blockwise import TracedBlockwiseFn
    torch._dynamo.reset()
    x, w, dy = _operands()
    compiled = torch.compile(lambda a, b: TracedBlockwiseFn.apply(a, b), fullgraph=True)  # a graph break raises
    eager = _run(TracedBlockwiseFn.apply, x, w, dy)
    got = _run(compiled, x, w, dy)
    for a, b in zip(got, eager):
        assert torch.equal(a, b)
