"""fp8_delayed's fused SwiGLU MLP (`fused_swiglu`, fp8_delayed.DelayedSwiGLUMLPFn) on a CPU: the real torch._scaled_mm
path runs here too, and the SwiGLU pass is fp8_swiglu_triton's torch reference (the kernel itself is checked against
that reference under Triton's interpreter, tests/precision/fp8_swiglu_interp_checks.py, and against inductor's
compiled step on a GPU, tests/precision/test_fused_swiglu_gpu.py). Here the three layers' own path (FP32) gets an
activation computing the reference's formula (ATen's CPU silu_backward can differ from it in the last bit of an
exp), so the fused MLP must give Y, dX, every dW, the amax history and the scales bit for bit, step after step: what
is checked is the GEMMs, casts, layouts and amax records around the SwiGLU."""
import copy

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from training.precision import fp8_delayed
from training.precision.fp8_delayed import DelayedScalingLinear, fuse_swiglu_mlp
from training.precision.registry import get_recipe


def _mlp(hidden=64, inter=96, bias=False, act="silu", **layer_kw):
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act=act, mlp_bias=bias))
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, DelayedScalingLinear(getattr(mlp, name), history_len=4, real=True, **layer_kw))
    return mlp


class _FormulaSiLU(torch.autograd.Function):
    """silu and its backward as fp8_swiglu_triton's formula (aten.silu_backward's decomposition, inductor's exp)."""

    @staticmethod
    def forward(ctx, g):
        ctx.save_for_backward(g)
        return g / (torch.exp(-g) + 1.0)

    @staticmethod
    def backward(ctx, grad):
        (g,) = ctx.saved_tensors
        sig = 1.0 / (torch.exp(-g) + 1.0)
        return (grad * sig) * (g * (1.0 - sig) + 1.0)


class _FormulaAct(nn.Module):
    def forward(self, g):
        return _FormulaSiLU.apply(g)


def _pair():
    """(the three layers' own path with the formula's activation, the same MLP fused)."""
    base = _mlp()
    fused = copy.deepcopy(base)
    assert _fuse(fused) == 1
    base.act_fn = _FormulaAct()
    return base, fused


def _fuse(mlp) -> int:
    block = nn.Module()  # fuse_swiglu_mlp takes a decoder block (its .mlp)
    block.mlp = mlp
    return fuse_swiglu_mlp(block)


def layers(mlp):
    return [mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def one_step(mod, owner, x, backward) -> tuple:
    """(y, dX, dW gate, up, down) of one training step of `mod` (owner: its uncompiled MLP), then the scales' update."""
    for layer in layers(owner):
        layer.weight.grad = None
    xi = x.clone().requires_grad_()
    y = mod(xi)
    backward(y)
    out = (y.detach().clone(), xi.grad.clone(), *[layer.weight.grad.clone() for layer in layers(owner)])
    for layer in layers(owner):
        layer.update_scales()
    return out


def assert_trained_alike(step, outs, base, fused) -> None:
    """The two MLPs' step outputs, amax histories and scales equal to the bit (and the outputs not zero)."""
    for name, want, got in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), *outs):
        assert got.abs().sum() > 0, f"step {step}: {name} is zero"
        assert torch.equal(got, want), f"step {step}: {name} differs ({(got != want).sum()} elements)"
    for a, b in zip(layers(base), layers(fused)):
        assert torch.equal(a.amax_history, b.amax_history), f"step {step}"
        assert torch.equal(a.scales, b.scales), f"step {step}"


class ApplySpy:
    """Counts the calls of an autograd Function's `apply` (default: fp8_delayed's fused MLP)."""

    def __init__(self, monkeypatch, fn=fp8_delayed.DelayedSwiGLUMLPFn):
        self.calls = 0
        apply = fn.apply

        def counted(*args):
            self.calls += 1
            return apply(*args)

        monkeypatch.setattr(fn, "apply", counted)


def _train_side_by_side(base, fused, steps, tokens=32):
    for step in range(steps):
        x = torch.randn(tokens, base.gate_proj.in_features) * (1 + step)
        dy = torch.randn(tokens, base.down_proj.out_features)
        outs = [one_step(m, m, x, lambda y: y.backward(dy)) for m in (base, fused)]
        assert_trained_alike(step, outs, base, fused)


def test_the_fused_mlp_trains_bit_for_bit_like_its_three_layers(monkeypatch):
    base, fused = _pair()
    assert _fuse(fused) == 0  # once
    spy = ApplySpy(monkeypatch)
    _train_side_by_side(base, fused, steps=4)
    # The first step has no history (just-in-time scales, the layers' own path); the other three are fused.
    assert spy.calls == 3
    # What lets the fused MLP cast X once with gate's input scale: up's input history and scale are the same.
    gate, up = fused.gate_proj, fused.up_proj
    assert torch.equal(gate.amax_history[0], up.amax_history[0]) and gate.amax_history[0].max() > 0
    assert torch.equal(gate.scales[0], up.scales[0])


def test_without_gradients_it_records_nothing_and_gives_the_same_output(monkeypatch):
    base, fused = _pair()
    _train_side_by_side(base, fused, steps=1)  # builds the history
    spy = ApplySpy(monkeypatch)
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert torch.equal(base(x), fused(x))
    assert spy.calls == 1
    assert all(torch.equal(layer.pending_amax, torch.zeros(3)) for layer in layers(fused))


def test_hooks_or_an_odd_token_count_take_the_layers_own_path(monkeypatch):
    base, fused = _pair()
    _train_side_by_side(base, fused, steps=1)
    spy = ApplySpy(monkeypatch)
    _train_side_by_side(base, fused, steps=1, tokens=24)  # torch._scaled_mm needs multiples of 16
    seen = []
    handle = fused.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    _train_side_by_side(base, fused, steps=1)
    handle.remove()
    assert spy.calls == 0 and seen == [torch.Size([32, 96])]


@pytest.mark.parametrize("what", ["bias", "gelu", "emulated", "fused_cast", "one_pass_off", "gate_up_fused"])
def test_only_real_one_pass_silu_mlps_without_bias_are_fused(what):
    kw = {"bias": what == "bias", "act": "gelu" if what == "gelu" else "silu"}
    layer_kw = {"fused_cast": what == "fused_cast", "one_pass_cast": what != "one_pass_off"}
    mlp = _mlp(**kw, **layer_kw)
    if what == "emulated":
        mlp.down_proj.real = False
    if what == "gate_up_fused":
        del mlp.gate_proj
    assert _fuse(mlp) == 0


def test_the_recipe_option_switches_it(monkeypatch):
    recipe = get_recipe("fp8_delayed")
    options = recipe.resolve_options({})
    assert options["fused_swiglu"] is True
    block = nn.Module()
    block.mlp = _mlp()
    assert recipe.share_inputs(block, {**options, "fused_swiglu": False}, real=True) == 0
    assert recipe.share_inputs(block, options, real=False) == 0
    assert recipe.share_inputs(block, options, real=True) == 1


def test_the_recipe_report_says_what_was_fused():
    # apply_recipe's note for the blocks share_inputs set up is the recipe's own, not NVFP4's shared-input wording.
    assert "fused_swiglu" in get_recipe("fp8_delayed").shared_note
    assert "quantize it once" in get_recipe("nvfp4").shared_note
