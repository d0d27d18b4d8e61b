"""GPU only (SM89+, skipped elsewhere): fp8_tensorwise's fused MLP and QKV projection (`fused_swiglu`,
`fused_qkv_rope` on our CurrentScalingLinear) change how the compiled step computes the current scales, the FP8
codes and their transposed layouts, not what they are. Compiled (inductor's default mode, fp8_tensorwise's), fused
against the layers' own path, over four steps whose operands' magnitudes change:
- a BF16 Llama MLP of three real CurrentScalingLinear layers: Y, dX and every dW bit for bit;
- a Llama attention block's fused QKV projection and RoPE, fed dQ, dK and dV laid out as cuDNN's attention backward
  writes them: q, k, v, dX and dW bit for bit.
The amax-only passes (fp8_swiglu_triton.swiglu_amax, fp8_rope_triton.rope_bwd_amax) set every scale here: an amax
off by one BF16 step would change the codes and so the outputs. (Eagerly the layers' path rounds h, dL/dg, dL/du
and dQKV to BF16 before the cast; inductor and the kernels do not, which is why the comparisons are compiled.)"""
import copy

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from tests.precision.test_fused_current import MLP_LAYERS, _qkv_block
from tests.precision.test_fused_qkv_rope_gpu import _front
from tests.qkv_front import cudnn_laid_out_grads, front_step
from training.precision.fp8_delayed import fuse_qkv_rope, fuse_swiglu_mlp
from training.precision.fp8_tensorwise import CurrentScalingLinear, fusable_current

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an SM89+ GPU (FP8 GEMMs)")


def _equal(step, names, want, got):
    for name, a, b in zip(names, want, got):
        assert b.abs().sum() > 0, f"step {step}: {name} is zero"
        assert torch.equal(a, b), f"step {step}: {name} differs ({(a != b).sum()} of {a.numel()} elements)"


def test_the_fused_mlp_trains_bit_for_bit_like_its_three_layers_compiled():
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = LlamaMLP(LlamaConfig(hidden_size=256, intermediate_size=512, hidden_act="silu"))
    for name in MLP_LAYERS:
        setattr(base, name, CurrentScalingLinear(getattr(base, name), real=True))
    base = base.to("cuda", torch.bfloat16)
    fused = copy.deepcopy(base)
    block = nn.Module()
    block.mlp = fused
    assert fuse_swiglu_mlp(block, fusable_current) == 1
    run = [torch.compile(m) for m in (base, fused)]
    for step in range(4):
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16) * (1 + step)
        scale = 10.0 ** (step - 2)  # dY's magnitude, and with it every gradient scale, changes
        outs = []
        for mod, owner in zip(run, (base, fused)):
            for name in MLP_LAYERS:
                getattr(owner, name).weight.grad = None
            xi = x.clone().requires_grad_()
            y = mod(xi)
            (y.float().square().sum() * scale).backward()
            outs.append((y.detach().clone(), xi.grad.clone(),
                         *[getattr(owner, n).weight.grad.clone() for n in MLP_LAYERS]))
        _equal(step, ("y", "dx", "dw_gate", "dw_up", "dw_down"), *outs)


def test_the_fused_qkv_projection_gives_the_layers_own_values_and_codes_compiled():
    torch._dynamo.reset()
    torch.manual_seed(0)
    base, rope = _qkv_block(hidden=256)
    base.self_attn.config._attn_implementation = "sdpa"
    base, rope = base.to("cuda", torch.bfloat16), rope.to("cuda")
    fused = copy.deepcopy(base)
    assert fuse_qkv_rope(fused, fusable_current) == 1
    batch, tokens, d = 2, 128, 64
    run = [torch.compile(lambda x, c, s, a=b.self_attn: _front(a, x, c, s)) for b in (base, fused)]
    for step in range(4):
        x = torch.randn(batch, tokens, 256, device="cuda", dtype=torch.bfloat16) * (1 + step)
        cos, sin = rope(x, torch.arange(tokens, device="cuda").unsqueeze(0))
        grads = cudnn_laid_out_grads(batch, tokens, d, (4, 2, 2), 10 ** (step - 3))
        results = [front_step(fn, b.self_attn, x, cos, sin, grads) for fn, b in zip(run, (base, fused))]
        _equal(step, ("q", "k", "v", "dx", "dw"), *results)
