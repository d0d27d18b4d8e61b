"""The RoPE-backward kernels against their torch references: fp8_delayed's fused QKV projection's (training/precision/
fp8_rope_triton.py: RoPE's backward of dQ and dK, the concatenation with dV, the E5M2 cast in both layouts and the
amax) and the BF16 one of training.perf.rope_backward (training/rope_triton.py: the same tile, dY in BF16), on CPU
under Triton's interpreter (started by test_fp8_rope_interpreted.py with TRITON_INTERPRET=1; skipped without it):
codes in both layouts and the amax to the bit. On a GPU the fused path is compared with inductor's compiled step
(test_fused_qkv_rope_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from tests.interpreted import require_interpreter

pytest.importorskip("triton")
require_interpreter("test_fp8_rope_interpreted.py")

from training.precision import fp8_rope_triton as fr  # noqa: E402
from training import rope_triton as rt  # noqa: E402
from training.precision.formats import fp8_cast  # noqa: E402


def _grads(batch, tokens, hq, hk, d, cos_batch, seed=0):
    """dQ, dK, dV with magnitudes 2^-30..2^-8 (times the scale: subnormal, normal and saturated codes), some zeros and
    -0.0; cos and sin of real RoPE angles (BF16, as HF hands them), for one or every sequence of the batch."""
    gen = torch.Generator().manual_seed(seed)

    def wide(*shape):
        return (torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-30, -8, shape, generator=gen).float()))

    dq, dk, dv = wide(batch, tokens, hq, d), wide(batch, tokens, hk, d), wide(batch, tokens, hk, d)
    dq[0, 0, 0, :3], dk[0, 1, 0, :3], dv[0, 2, 0, :3] = 0.0, -0.0, 0.0
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = (torch.arange(tokens).float()[:, None] + 3 * torch.arange(cos_batch).float()[:, None, None]) * inv
    emb = torch.cat([angles, angles], dim=-1)
    return dq.bfloat16(), dk.bfloat16(), dv.bfloat16(), emb.cos().bfloat16(), emb.sin().bfloat16()


def _codes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("batch,tokens,hq,hk,d,cos_batch,bm", [
    (2, 24, 4, 2, 16, 1, 32),  # 48 rows: a partial row tile; cos shared by the batch (HF's [1, T, D])
    (2, 16, 2, 1, 64, 2, 16),  # cos per sequence; a smaller tile
])
def test_codes_in_both_layouts_and_the_amax_are_the_references(batch, tokens, hq, hk, d, cos_batch, bm):
    dq, dk, dv, cos, sin = _grads(batch, tokens, hq, hk, d, cos_batch)
    scale = torch.tensor(57344.0 / 2e-4)
    got = fr.rope_bwd_fp8_launch(dq, dk, dv, cos, sin, scale, bm=bm)
    want = fr.rope_bwd_fp8_reference(dq, dk, dv, cos, sin, scale)
    rows, cols = batch * tokens, (hq + 2 * hk) * d
    assert got[0].dtype == torch.float8_e5m2 and got[0].shape == (rows, cols) and got[1].shape == (cols, rows)
    assert torch.equal(_codes(got[0]), _codes(want[0])) and torch.equal(_codes(got[1]), _codes(want[1]))
    assert torch.equal(got[2], want[2]) and got[2] > 0
    assert (_codes(got[0]) & 0x7F == 0x7B).any()  # some saturate at 57344
    # the V columns are dV's codes, untouched by RoPE; the Q columns are not dQ's
    plain = lambda t: _codes(fp8_cast(t.float().reshape(rows, -1), scale, torch.float8_e5m2)[0])  # noqa: E731
    assert torch.equal(_codes(got[0][:, (hq + hk) * d:]), plain(dv))
    assert not torch.equal(_codes(got[0][:, :hq * d]), plain(dq))
    # current scaling's first pass: the same amax with the stores compiled out
    amax_only = fr.rope_bwd_fp8_launch(dq, dk, dv, cos, sin, None, bm=bm, store=False)
    assert torch.equal(amax_only, want[2]) and torch.equal(fr.rope_bwd_amax(dq, dk, dv, cos, sin), want[2])
    # `rounded` (current scaling): the codes of the BF16-rounded values, the same amax
    got_r = fr.rope_bwd_fp8_launch(dq, dk, dv, cos, sin, scale, bm=bm, rounded=True)
    want_r = fr.rope_bwd_fp8_reference(dq, dk, dv, cos, sin, scale, rounded=True)
    assert torch.equal(_codes(got_r[0]), _codes(want_r[0])) and torch.equal(_codes(got_r[1]), _codes(want_r[1]))
    assert torch.equal(got_r[2], want[2])
    rounded_first = fp8_cast(fr.rope_bwd_values(dq, dk, dv, cos, sin).bfloat16().float(), scale, torch.float8_e5m2)
    assert torch.equal(_codes(want_r[0]), _codes(rounded_first[0]))
    assert (_codes(got_r[0]) != _codes(got[0])).any()  # double rounding shows in some codes (26 of 6144 here)


def test_strided_gradients_as_the_attention_backward_may_hand_them():
    # dQ laid out [batch, heads, tokens, head_dim] and seen through a transpose: reshaped to rows by a copy
    dq, dk, dv, cos, sin = _grads(2, 16, 2, 1, 32, 1, seed=3)
    dq_t = dq.transpose(1, 2).contiguous().transpose(1, 2)
    scale = torch.tensor(57344.0 / 1e-3)
    got = fr.rope_bwd_fp8_launch(dq_t, dk, dv, cos, sin, scale)
    want = fr.rope_bwd_fp8_reference(dq, dk, dv, cos, sin, scale)
    assert all(torch.equal(_codes(a), _codes(b)) for a, b in zip(got[:2], want[:2])) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("halves", [False, True], ids=["tile", "halves"])
@pytest.mark.parametrize("batch,tokens,hq,hk,d,cos_batch,bm", [
    (2, 24, 4, 2, 16, 1, 32),  # a partial row tile; cos shared by the batch
    (2, 16, 2, 1, 64, 2, 16),  # cos per sequence; a smaller tile
])
def test_the_bf16_kernel_is_its_reference_to_the_bit(batch, tokens, hq, hk, d, cos_batch, bm, halves):
    dq, dk, dv, cos, sin = _grads(batch, tokens, hq, hk, d, cos_batch, seed=1)
    got = rt.rope_bwd_launch(dq, dk, dv, cos, sin, bm=bm, halves=halves)
    want = rt.rope_bwd_reference(dq, dk, dv, cos, sin)
    rows = batch * tokens
    assert got.dtype == torch.bfloat16 and got.shape == (rows, (hq + 2 * hk) * d)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(got[:, (hq + hk) * d:], dv.reshape(rows, -1))  # V copied
    assert not torch.equal(got[:, :hq * d], dq.reshape(rows, -1))  # Q rotated
    dq_t = dq.transpose(1, 2).contiguous().transpose(1, 2)  # strided, as an attention backward may hand it
    strided = rt.rope_bwd_launch(dq_t, dk, dv, cos, sin, bm=bm, halves=halves)
    assert torch.equal(strided.view(torch.int16), got.view(torch.int16))
