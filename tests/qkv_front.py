"""Shared by the GPU tests that feed a fused QKV projection's front (projection and RoPE, up to SDPA's inputs) the
gradients cuDNN's attention backward hands back (tests/training/test_rope_backward_gpu.py,
tests/precision/test_fused_qkv_rope_gpu.py, tests/precision/test_fused_current_gpu.py)."""
from __future__ import annotations

import torch


def cudnn_laid_out_grads(batch: int, tokens: int, head_dim: int, heads, scale: float, device="cuda") -> list:
    """Random dQ, dK, dV in BF16 (times `scale`), one per entry of `heads`: [batch, tokens, heads, head_dim] memory
    seen as [batch, heads, tokens, head_dim], the layout cuDNN's attention backward writes."""
    return [(torch.randn(batch, tokens, h, head_dim, device=device) * scale).bfloat16().transpose(1, 2)
            for h in heads]


def front_step(fn, attn, x, cos, sin, grads, cuda_graphs: bool = False) -> tuple:
    """(q, k, v, dX, dW of attn.qkv_proj) of one forward and backward of `fn(x, cos, sin)` (the attention front, maybe
    compiled) with `grads` as the gradients of q, k and v. `cuda_graphs`: a new CUDA-graph step begins first."""
    attn.qkv_proj.weight.grad = None
    xi = x.clone().requires_grad_()
    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
    qkv = fn(xi, cos, sin)
    values = [t.detach().clone() for t in qkv]
    torch.autograd.backward(qkv, grads)
    return (*values, xi.grad.clone(), attn.qkv_proj.weight.grad.clone())
