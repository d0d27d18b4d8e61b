"""GPU only (SM89+, skipped elsewhere): fp8_delayed's fused SwiGLU MLP (`fused_swiglu`) changes how the compiled step
computes the activation's FP8 codes, their transposed layouts and amaxes, not what they are. A BF16 Llama MLP of
three real fp8_delayed layers, compiled (inductor's default mode, and CUDA graphs), fused against its own three
layers: Y, dX, every dW, the amax histories and the scales bit for bit over five steps (the first before the history
exists, on the layers' own path). And the kernel alone against inductor's compilation of the same ops on a larger
shape. (Eagerly the layers' own path rounds h and dL/dg, dL/du to BF16 before the cast; inductor and the kernel do
not, which is why the comparison is compiled.)"""
import copy

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from tests.precision.test_fused_swiglu import assert_trained_alike, one_step
from training.precision.formats import fp8_cast
from training.precision.fp8_delayed import DelayedScalingLinear, fuse_swiglu_mlp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an SM89+ GPU (FP8 GEMMs)")


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["compiled", "cuda_graphs"])
def test_the_fused_mlp_trains_bit_for_bit_like_its_three_layers_compiled(mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = LlamaMLP(LlamaConfig(hidden_size=256, intermediate_size=512, hidden_act="silu"))
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(base, name, DelayedScalingLinear(getattr(base, name), history_len=4, real=True))
    base = base.to("cuda", torch.bfloat16)
    fused = copy.deepcopy(base)
    block = nn.Module()
    block.mlp = fused
    assert fuse_swiglu_mlp(block) == 1
    run = [torch.compile(m, mode=mode) for m in (base, fused)]
    for step in range(5):
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16) * (1 + step)
        outs = []
        for mod, owner in zip(run, (base, fused)):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            outs.append(one_step(mod, owner, x, lambda y: y.float().square().sum().backward()))
        assert_trained_alike(step, outs, base, fused)


def test_the_kernel_gives_inductors_codes_and_amaxes():
    from training.precision import fp8_swiglu_triton as fs

    torch.manual_seed(0)
    m, n = 1024, 2048
    g = (torch.randn(m, n, device="cuda") * 4).bfloat16()
    u, dh = torch.randn(m, n, device="cuda").bfloat16(), (torch.randn(m, n, device="cuda") * 1e-3).bfloat16()
    s_h, s_g, s_u = (torch.tensor(v, device="cuda") for v in (448.0 / 8, 57344.0 / 0.01, 57344.0 / 0.004))

    def amax(t):
        return t.abs().amax(dim=-1).amax().to(torch.float32)

    def forward(g, u, s):
        h = torch.nn.functional.silu(g) * u
        return fp8_cast(h, s, torch.float8_e4m3fn)[0], amax(h)

    def backward(g, u, dh, sg, su):
        dg = torch.ops.aten.silu_backward(dh * u, g)
        du = dh * torch.nn.functional.silu(g)
        return (fp8_cast(dg, sg, torch.float8_e5m2)[0], amax(dg), fp8_cast(du, su, torch.float8_e5m2)[0], amax(du))

    q, a = torch.compile(forward)(g, u, s_h)
    got = fs.swiglu_fp8_fwd(g, u, s_h)
    assert torch.equal(got[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got[1].view(torch.uint8), q.t().contiguous().view(torch.uint8)) and torch.equal(got[2], a)
    want = torch.compile(backward)(g, u, dh, s_g, s_u)
    got = fs.swiglu_fp8_bwd(g, u, dh, s_g, s_u)
    for (q, a), (gq, gqt, ga) in zip((want[:2], want[2:]), (got[:3], got[3:])):
        assert torch.equal(gq.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(gqt.view(torch.uint8), q.t().contiguous().view(torch.uint8)) and torch.equal(ga, a)
