"""GPU only (SM89+, skipped elsewhere): fp8_delayed's fused QKV projection and RoPE (`fused_qkv_rope`) changes how the
compiled step computes the projection's dY codes, their transposed layout and amax, not what they are.

- A BF16 Llama attention block whose fused QKV projection is a real fp8_delayed layer, compiled (inductor's default
  mode, and CUDA graphs), fused against its own path: attention output, dX, dW, the amax history and the scales bit
  for bit over five steps (the first before the history exists, on the layer's own path). Eager attention (matmuls):
  a deterministic backward, whose dQ and dK arrive [batch, heads, tokens, head_dim]-contiguous.
- The projection and RoPE alone, fed the same dQ, dK and dV laid out as cuDNN's attention backward writes them (the
  training step's layout: [batch, tokens, heads, head_dim] memory seen as [batch, heads, tokens, head_dim]), compiled
  both ways: dX, dW and dY's amax bit for bit.
(Eagerly the layer's own path rounds dQKV to BF16 before the cast; inductor and the kernel do not, which is why the
comparison is compiled.)"""
import copy

import pytest
import torch
from transformers.models.llama import modeling_llama as ml

from tests.precision.test_fused_qkv_rope import assert_trained_alike, make_block, one_step
from training.precision.fp8_delayed import fuse_qkv_rope

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an SM89+ GPU (FP8 GEMMs)")


def _gpu_pair(attn_implementation):
    torch.manual_seed(0)
    base, rope = make_block(hidden=256, heads=4, kv_heads=2)
    base.self_attn.config._attn_implementation = attn_implementation
    base, rope = base.to("cuda", torch.bfloat16), rope.to("cuda")
    fused = copy.deepcopy(base)
    assert fuse_qkv_rope(fused) == 1
    return base, fused, rope


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["compiled", "cuda_graphs"])
def test_the_fused_projection_trains_bit_for_bit_like_the_layers_own_path_compiled(mode):
    torch._dynamo.reset()
    base, fused, rope = _gpu_pair("eager")
    run = [torch.compile(b.self_attn, mode=mode) for b in (base, fused)]
    for step in range(5):
        x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16) * (1 + step)
        pos = rope(x, torch.arange(64, device="cuda").unsqueeze(0))
        dy = torch.randn_like(x)
        outs = []
        for mod, owner in zip(run, (base, fused)):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            outs.append(one_step(mod, x, pos, dy, owner=owner.self_attn))
        assert_trained_alike(step, outs, base, fused)


def _front(attn, x, cos, sin):
    """The attention forward up to SDPA's inputs (training.model._fused_qkv_attention_forward's first lines)."""
    fused = attn.qkv_rope(x, cos, sin) if getattr(attn, "qkv_rope", None) is not None else None
    if fused is not None:
        return tuple(t.transpose(1, 2) for t in fused)
    q, k, v = attn.qkv_proj(x).split(attn.qkv_split, dim=-1)
    q, k, v = (t.reshape(*x.shape[:-1], -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))
    q, k = ml.apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def test_cudnn_laid_out_gradients_give_the_layers_own_codes_compiled():
    torch._dynamo.reset()
    base, fused, rope = _gpu_pair("sdpa")
    batch, tokens, d = 2, 128, 64
    run = [torch.compile(lambda x, c, s, a=b.self_attn: _front(a, x, c, s)) for b in (base, fused)]
    for step in range(4):
        x = torch.randn(batch, tokens, 256, device="cuda", dtype=torch.bfloat16)
        cos, sin = rope(x, torch.arange(tokens, device="cuda").unsqueeze(0))
        # [batch, tokens, heads, head_dim] memory, seen as [batch, heads, tokens, head_dim] (cuDNN's dQ, dK, dV)
        grads = [(torch.randn(batch, tokens, h, d, device="cuda") * 10 ** (step - 3)).bfloat16().transpose(1, 2)
                 for h in (4, 2, 2)]
        results = []
        for fn, block in zip(run, (base, fused)):
            layer = block.self_attn.qkv_proj
            layer.weight.grad = None
            xi = x.clone().requires_grad_()
            torch.autograd.backward(fn(xi, cos, sin), grads)
            results.append((xi.grad.clone(), layer.weight.grad.clone(), layer.grad_amax_token.grad.clone()))
            layer.update_scales()
        for name, want, got in zip(("dx", "dw", "dy_amax"), *results):
            assert got.abs().sum() > 0 and torch.equal(got, want), f"step {step}: {name}"
        assert torch.equal(base.self_attn.qkv_proj.scales, fused.self_attn.qkv_proj.scales)
