"""GPU only (SM89+, skipped elsewhere): fp8_delayed's fused QKV projection and RoPE (`fused_qkv_rope`) changes how the
compiled step computes the projection's dY codes, their transposed layout and amax, not what they are.

- The projection and RoPE of a BF16 Llama attention block whose fused QKV projection is a real fp8_delayed layer,
  compiled (inductor's default mode, and CUDA graphs), fused against the layer's own path, both fed the same dQ, dK
  and dV laid out as cuDNN's attention backward writes them (the training step's layout: [batch, tokens, heads,
  head_dim] memory seen as [batch, heads, tokens, head_dim]): q, k, v, dX, dW, dY's amax and the scales bit for bit
  over four steps (the first before the history exists, on the layer's own path).
- The whole block with eager attention (matmuls) compiled: there the layer's own path differs in the last bits. Its
  dQ and dK end in the softmax scale's multiply, which inductor fuses into the RoPE-backward-and-cast kernel without
  rounding the product to BF16; the fused path receives the BF16 gradient the attention hands out (eager's
  rounding). Same forward, gradients within BF16/FP8 rounding.
(Eagerly the layer's own path rounds dQKV to BF16 before the cast; inductor and the kernel do not, which is why the
comparisons are compiled.)"""
import copy

import pytest
import torch
from transformers.models.llama import modeling_llama as ml

from tests.precision.test_fused_qkv_rope import make_block, one_step
from tests.qkv_front import cudnn_laid_out_grads, front_step
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


def _front(attn, x, cos, sin):
    """The attention forward up to SDPA's inputs (training.model._fused_qkv_attention_forward's first lines)."""
    fused = attn.qkv_rope(x, cos, sin) if getattr(attn, "qkv_rope", None) is not None else None
    if fused is not None:
        return tuple(t.transpose(1, 2) for t in fused)
    q, k, v = attn.qkv_proj(x).split(attn.qkv_split, dim=-1)
    q, k, v = (t.reshape(*x.shape[:-1], -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))
    q, k = ml.apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["compiled", "cuda_graphs"])
def test_cudnn_laid_out_gradients_give_the_layers_own_values_and_codes_compiled(mode):
    torch._dynamo.reset()
    base, fused, rope = _gpu_pair("sdpa")
    batch, tokens, d = 2, 128, 64
    run = [torch.compile(lambda x, c, s, a=b.self_attn: _front(a, x, c, s), mode=mode) for b in (base, fused)]
    for step in range(4):
        x = torch.randn(batch, tokens, 256, device="cuda", dtype=torch.bfloat16)
        cos, sin = rope(x, torch.arange(tokens, device="cuda").unsqueeze(0))
        grads = cudnn_laid_out_grads(batch, tokens, d, (4, 2, 2), 10 ** (step - 3))
        results = []
        for fn, block in zip(run, (base, fused)):
            layer = block.self_attn.qkv_proj
            outs = front_step(fn, block.self_attn, x, cos, sin, grads, mode == "reduce-overhead")
            results.append((*outs, layer.grad_amax_token.grad.clone()))
            layer.update_scales()
        for name, want, got in zip(("q", "k", "v", "dx", "dw", "dy_amax"), *results):
            assert got.abs().sum() > 0 and torch.equal(got, want), f"step {step}: {name}"
        assert torch.equal(base.self_attn.qkv_proj.amax_history, fused.self_attn.qkv_proj.amax_history)
        assert torch.equal(base.self_attn.qkv_proj.scales, fused.self_attn.qkv_proj.scales)


def test_a_block_with_eager_attention_trains_alike_compiled():
    torch._dynamo.reset()
    base, fused, rope = _gpu_pair("eager")
    run = [torch.compile(b.self_attn) for b in (base, fused)]
    for step in range(3):
        x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16) * (1 + step)
        pos = rope(x, torch.arange(64, device="cuda").unsqueeze(0))
        dy = torch.randn_like(x)
        (out_b, dx_b, dw_b), (out_f, dx_f, dw_f) = (one_step(m, x, pos, dy, owner=b.self_attn)
                                                    for m, b in zip(run, (base, fused)))
        if step < 2:  # the first fused step starts from the same weights
            assert torch.equal(out_f, out_b), f"step {step}"
        for name, got, want in (("dx", dx_f, dx_b), ("dw", dw_f, dw_b)):
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert 0 < want.float().abs().sum() and err < 0.05, f"step {step}: {name} rel. error {err:.3g}"
        assert torch.allclose(base.self_attn.qkv_proj.scales, fused.self_attn.qkv_proj.scales, rtol=0.02)
