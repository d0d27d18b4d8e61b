"""fp8_tensorwise's fused MLP and QKV projection (options `fused_swiglu`, `fused_qkv_rope`): fp8_delayed's fused
functions (DelayedSwiGLUMLPFn, DelayedQKVRoPEFn) run with current scaling on our CurrentScalingLinear layers. On a CPU
the real torch._scaled_mm path runs and the SwiGLU and RoPE passes are their torch references (the kernels, amax-only
pass included, are checked against those under Triton's interpreter, and against inductor's compiled step on a GPU,
test_fused_current_gpu.py). Fused against the layers' own path (FP32; the MLP's activation the kernels' formula):
Y, dX and every dW bit for bit, every step (no history: the first step is fused too)."""
import copy

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from tests.precision.test_fused_qkv_rope import HEADS, HIDDEN, KV_HEADS
from tests.precision.test_fused_qkv_rope import make_block as make_delayed_block
from tests.precision.test_fused_swiglu import ApplySpy, _FormulaAct
from training.precision import fp8_delayed
from training.precision.fp8_delayed import fuse_qkv_rope, fuse_swiglu_mlp
from training.precision.fp8_tensorwise import CurrentScalingLinear, fusable_current
from training.precision.registry import get_recipe

MLP_LAYERS = ("gate_proj", "up_proj", "down_proj")


def _mlp(bias=False, act="silu"):
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=96, hidden_act=act, mlp_bias=bias))
    for name in MLP_LAYERS:
        setattr(mlp, name, CurrentScalingLinear(getattr(mlp, name), real=True))
    return mlp


def _in_block(**children) -> nn.Module:
    block = nn.Module()  # the fuse functions take a decoder block
    for name, child in children.items():
        setattr(block, name, child)
    return block


def _mlp_pair():
    base = _mlp()
    fused = copy.deepcopy(base)
    assert fuse_swiglu_mlp(_in_block(mlp=fused), fusable_current) == 1
    base.act_fn = _FormulaAct()
    return base, fused


def _step(mod, x, dy, weights) -> tuple:
    for w in weights:
        w.grad = None
    xi = x.clone().requires_grad_()
    y = mod(xi)
    y.backward(dy)
    return (y.detach().clone(), xi.grad.clone(), *[w.grad.clone() for w in weights])


def _assert_equal(step, names, want, got):
    for name, a, b in zip(names, want, got):
        assert b.abs().sum() > 0, f"step {step}: {name} is zero"
        assert torch.equal(a, b), f"step {step}: {name} differs ({(a != b).sum()} elements)"


def _train_mlps(base, fused, steps, tokens=32):
    for step in range(steps):
        x = torch.randn(tokens, 64) * (1 + step)
        dy = torch.randn(tokens, 64) * 10.0 ** (step - 2)  # the gradients' scales change too
        outs = [_step(m, x, dy, [getattr(m, n).weight for n in MLP_LAYERS]) for m in (base, fused)]
        _assert_equal(step, ("y", "dx", "dw_gate", "dw_up", "dw_down"), *outs)


def test_the_fused_mlp_trains_bit_for_bit_like_its_three_current_scaling_layers(monkeypatch):
    base, fused = _mlp_pair()
    assert fuse_swiglu_mlp(_in_block(mlp=fused), fusable_current) == 0  # once
    spy = ApplySpy(monkeypatch)
    _train_mlps(base, fused, steps=4)
    assert spy.calls == 4  # every step: current scaling needs no history


def test_an_odd_token_count_or_hooks_take_the_layers_own_path(monkeypatch):
    base, fused = _mlp_pair()
    spy = ApplySpy(monkeypatch)
    _train_mlps(base, fused, steps=1, tokens=24)  # torch._scaled_mm needs multiples of 16
    handle = fused.up_proj.register_forward_hook(lambda m, i, o: None)
    _train_mlps(base, fused, steps=1)
    handle.remove()
    assert spy.calls == 0


@pytest.mark.parametrize("what", ["bias", "gelu", "emulated", "mixed"])
def test_only_real_silu_mlps_of_current_scaling_layers_without_bias_are_fused(what):
    mlp = _mlp(bias=what == "bias", act="gelu" if what == "gelu" else "silu")
    if what == "emulated":
        mlp.down_proj.real = False
    if what == "mixed":  # a layer of another kind (fp8_delayed's) is not fused with current-scaling ones
        mlp.up_proj = fp8_delayed.DelayedScalingLinear(nn.Linear(64, 96, bias=False), history_len=4, real=True)
    assert fuse_swiglu_mlp(_in_block(mlp=mlp), fusable_current) == 0
    assert fuse_swiglu_mlp(_in_block(mlp=mlp)) == 0  # nor by fp8_delayed's own test


def _qkv_block(**dims):
    """(a 1-layer Llama's decoder block whose fused qkv_proj is a real CurrentScalingLinear, its RoPE module)."""
    block, rope = make_delayed_block(**dims)
    attn = block.self_attn
    delayed = attn.qkv_proj
    linear = nn.Linear(delayed.in_features, delayed.out_features, bias=False)
    linear.weight = delayed.weight
    attn.qkv_proj = CurrentScalingLinear(linear, real=True)
    return block, rope


def _train_attention(base, fused, rope, steps, batch=2, tokens=16):
    for step in range(steps):
        x = torch.randn(batch, tokens, HIDDEN) * (1 + step)
        pos = rope(x, torch.arange(tokens).unsqueeze(0))
        dy = torch.randn(batch, tokens, HIDDEN) * 10.0 ** (step - 2)

        def attend(attn):
            return lambda xi: attn(xi, position_embeddings=pos, attention_mask=None)[0]

        outs = [_step(attend(b.self_attn), x, dy, [b.self_attn.qkv_proj.weight]) for b in (base, fused)]
        _assert_equal(step, ("out", "dx", "dw_qkv"), *outs)


def test_the_fused_qkv_projection_trains_bit_for_bit_like_the_current_scaling_layer(monkeypatch):
    base, rope = _qkv_block()
    fused = copy.deepcopy(base)
    assert fuse_qkv_rope(fused, fusable_current) == 1 and fuse_qkv_rope(fused, fusable_current) == 0
    spy = ApplySpy(monkeypatch, fp8_delayed.DelayedQKVRoPEFn)
    _train_attention(base, fused, rope, steps=3)
    assert spy.calls == 3
    _train_attention(base, fused, rope, steps=1, batch=1, tokens=24)  # odd token count: the layer's own path
    assert spy.calls == 3


def test_the_recipe_options_switch_them():
    recipe = get_recipe("fp8_tensorwise")
    options = recipe.resolve_options({})
    assert options["fused_swiglu"] is True and options["fused_qkv_rope"] is True
    block, _ = _qkv_block()
    block.mlp = _mlp()
    off = {**options, "fused_swiglu": False, "fused_qkv_rope": False}
    assert recipe.share_inputs(block, off, real=True) == 0
    assert recipe.share_inputs(block, options, real=False) == 0
    assert getattr(block.self_attn, "qkv_rope", None) is None and not getattr(block.mlp, "_plab_fused_swiglu", False)
    assert recipe.share_inputs(block, {**options, "fused_qkv_rope": False}, real=True) == 1
    assert block.mlp._plab_fused_swiglu and getattr(block.self_attn, "qkv_rope", None) is None
    assert recipe.share_inputs(block, options, real=True) == 1 and block.self_attn.qkv_rope is not None
    assert "fused_swiglu" in recipe.shared_note and "fused_qkv_rope" in recipe.shared_note


def test_fp8_tensorwise_on_torchaos_linear_or_emulated_fuses_nothing():
    """implementation torchao converts to torchao's Float8Linear, and emulated GEMMs to the emulation: neither is
    one of our current-scaling layers, so neither is fused."""
    from training.precision.fp8_tensorwise import torchao_float8_linear
    from training.precision.registry import apply_recipe

    pytest.importorskip("torchao")
    recipe = get_recipe("fp8_tensorwise")
    options = recipe.resolve_options({"implementation": "torchao"})
    block, _ = _qkv_block()
    block.self_attn.qkv_proj = torchao_float8_linear(nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HIDDEN // HEADS,
                                                               bias=False), "tensorwise")
    block.mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=96, hidden_act="silu"))
    for name in MLP_LAYERS:
        setattr(block.mlp, name, torchao_float8_linear(getattr(block.mlp, name), "tensorwise"))
    assert recipe.share_inputs(block, options, real=True) == 0
    # emulated, through apply_recipe as a run converts: no note, nothing set up
    block, _ = _qkv_block()
    block.self_attn.qkv_proj = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HIDDEN // HEADS, bias=False)
    block.mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=96, hidden_act="silu"))
    model = nn.Module()
    model.layers = nn.ModuleList([block])
    report = apply_recipe(model, "fp8_tensorwise", backend="emulated")
    assert not any("fused_swiglu" in note for note in report.notes), report.notes
    assert getattr(block.self_attn, "qkv_rope", None) is None and not getattr(block.mlp, "_plab_fused_swiglu", False)
