"""fp8_delayed's fused QKV projection and RoPE (`fused_qkv_rope`, fp8_delayed.DelayedQKVRoPEFn) on a CPU: the real
torch._scaled_mm path runs here too, and the backward's pass is fp8_rope_triton's torch reference (the kernel itself
is checked against that reference under Triton's interpreter, tests/precision/fp8_rope_interp_checks.py, and the
fused path against inductor's compiled step on a GPU, tests/precision/test_fused_qkv_rope_gpu.py). A Llama attention
block with a fused QKV projection that is a real fp8_delayed layer, fused against its own path (FP32): the attention
output, dX, dW, the amax history and the scales bit for bit, step after step."""
import copy

import pytest
import torch

from tests.precision.test_fused_swiglu import ApplySpy
from training.model import build_model, fuse_qkv, llama_config
from training.precision import fp8_delayed
from training.precision.fp8_delayed import DelayedScalingLinear, fuse_qkv_rope
from training.precision.registry import get_recipe

HIDDEN, HEADS, KV_HEADS = 64, 4, 2


def make_block(bias=False, head_dim=None, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, **layer_kw):
    """(decoder block 0 of a 1-layer Llama whose fused qkv_proj is a real fp8_delayed layer, its RoPE module)."""
    dims = {"hidden_size": hidden, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads}
    if head_dim:
        dims["head_dim"] = head_dim
    config = llama_config(dims, 97, 32)
    config.attention_bias = bias
    model = build_model(config, 3)
    fuse_qkv(model)
    block = model.model.layers[0]
    attn = block.self_attn
    attn.qkv_proj = DelayedScalingLinear(attn.qkv_proj, history_len=4, real=True, **layer_kw)
    return block, model.model.rotary_emb


def _pair():
    base, rope = make_block()
    fused = copy.deepcopy(base)
    assert fuse_qkv_rope(fused) == 1
    return base, fused, rope


def one_step(attn, x, pos, dy, owner=None) -> tuple:
    """(attention output, dX, dW of qkv_proj) of one training step of `attn` (owner: its uncompiled module), then the
    scales' update."""
    layer = (owner or attn).qkv_proj
    layer.weight.grad = None
    xi = x.clone().requires_grad_()
    out = attn(xi, position_embeddings=pos, attention_mask=None)[0]
    out.backward(dy)
    result = (out.detach().clone(), xi.grad.clone(), layer.weight.grad.clone())
    layer.update_scales()
    return result


def assert_trained_alike(step, outs, base, fused) -> None:
    for name, want, got in zip(("out", "dx", "dw_qkv"), *outs):
        assert got.abs().sum() > 0, f"step {step}: {name} is zero"
        assert torch.equal(got, want), f"step {step}: {name} differs ({(got != want).sum()} elements)"
    a, b = base.self_attn.qkv_proj, fused.self_attn.qkv_proj
    assert torch.equal(a.amax_history, b.amax_history) and a.amax_history[2].max() > 0, f"step {step}"
    assert torch.equal(a.scales, b.scales), f"step {step}"


def _Spy(monkeypatch):
    return ApplySpy(monkeypatch, fp8_delayed.DelayedQKVRoPEFn)


def train_side_by_side(base, fused, rope, steps, batch=2, tokens=16):
    for step in range(steps):
        x = torch.randn(batch, tokens, HIDDEN) * (1 + step)
        pos = rope(x, torch.arange(tokens).unsqueeze(0))
        dy = torch.randn(batch, tokens, HIDDEN)
        outs = [one_step(b.self_attn, x, pos, dy) for b in (base, fused)]
        assert_trained_alike(step, outs, base, fused)


def test_the_fused_projection_trains_bit_for_bit_like_the_layers_own_path(monkeypatch):
    base, fused, rope = _pair()
    assert fuse_qkv_rope(fused) == 0  # once
    spy = _Spy(monkeypatch)
    train_side_by_side(base, fused, rope, steps=4)
    assert spy.calls == 3  # the first step has no history (just-in-time scales, the layer's own path)


def test_without_gradients_it_records_nothing_and_gives_the_same_output(monkeypatch):
    base, fused, rope = _pair()
    train_side_by_side(base, fused, rope, steps=1)
    spy = _Spy(monkeypatch)
    x = torch.randn(2, 16, HIDDEN)
    pos = rope(x, torch.arange(16).unsqueeze(0))
    with torch.no_grad():
        assert torch.equal(base.self_attn(x, position_embeddings=pos, attention_mask=None)[0],
                           fused.self_attn(x, position_embeddings=pos, attention_mask=None)[0])
    assert spy.calls == 1 and torch.equal(fused.self_attn.qkv_proj.pending_amax, torch.zeros(3))


def test_hooks_or_an_odd_token_count_take_the_layers_own_path(monkeypatch):
    base, fused, rope = _pair()
    train_side_by_side(base, fused, rope, steps=1)
    spy = _Spy(monkeypatch)
    train_side_by_side(base, fused, rope, steps=1, batch=1, tokens=24)  # torch._scaled_mm needs multiples of 16
    seen = []
    handle = fused.self_attn.qkv_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    train_side_by_side(base, fused, rope, steps=1)
    handle.remove()
    assert spy.calls == 0 and seen == [torch.Size([2, 16, (HEADS + 2 * KV_HEADS) * HIDDEN // HEADS])]


@pytest.mark.parametrize("what", ["bias", "emulated", "fused_cast", "one_pass_off", "head_dim_24", "not_fused_qkv"])
def test_only_real_one_pass_fused_projections_without_bias_are_fused(what):
    block, _ = make_block(bias=what == "bias", head_dim=24 if what == "head_dim_24" else None,
                          fused_cast=what == "fused_cast", one_pass_cast=what != "one_pass_off")
    if what == "emulated":
        block.self_attn.qkv_proj.real = False
    if what == "not_fused_qkv":
        del block.self_attn.qkv_proj
    assert fuse_qkv_rope(block) == 0


def test_the_recipe_option_switches_it():
    recipe = get_recipe("fp8_delayed")
    options = recipe.resolve_options({})
    assert options["fused_qkv_rope"] is True
    off = {**options, "fused_qkv_rope": False, "fused_swiglu": False}
    block, _ = make_block()
    assert recipe.share_inputs(block, off, real=True) == 0 and getattr(block.self_attn, "qkv_rope", None) is None
    assert recipe.share_inputs(block, options, real=False) == 0
    assert recipe.share_inputs(block, {**options, "fused_swiglu": False}, real=True) == 1
    assert block.self_attn.qkv_rope is not None
    assert "fused_qkv_rope" in recipe.shared_note
