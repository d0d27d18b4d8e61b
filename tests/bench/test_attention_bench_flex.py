"""bench/attention_bench.py's FlexAttention row, on a CPU: the causal, natively-GQA flex attention it times gives
SDPA's math output (uncompiled flex here, forward only: flex has no backward on a CPU; the GPU compiles both and the
bench compares the gradients with the FP32 math reference there)."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.attention_bench import flex_fwd_bwd


def test_flex_row_computes_causal_gqa_attention():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 256, 32, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 256, 32, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 4, 256, 32, generator=g, dtype=torch.float64)
    got = flex_fwd_bwd(compiled=False, backward=False)(q, k, v, dout)
    assert got[1:] == (None, None, None)
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got[0], out, rtol=1e-9, atol=1e-9)
    # not causal would differ: the mask is applied
    with sdpa_kernel([SDPBackend.MATH]):
        full = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)
    assert not torch.allclose(got[0], full)
