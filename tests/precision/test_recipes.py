"""apply_recipe on a real tiny LlamaForCausalLM: what gets converted, how each recipe's GEMMs behave, delayed
scaling's state, numerics telemetry, and the first training steps against BF16."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from training import checkpoint as ckpt
from training.model import build_model, llama_config
from training.precision import RECIPES, apply_recipe
from training.precision.emulation import QuantizedLinear
from training.precision.fp8_delayed import DelayedScalingLinear

LOW_PRECISION = [r for r in RECIPES if r != "bf16"]
BLOCK_LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
VOCAB, SEQ = 256, 32


def tiny_model(seed: int = 0):
    return build_model(llama_config("tiny", VOCAB, SEQ), seed)


def batch(seed: int = 0, size: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


# ------------------------------------------------------------------------------------ conversion report
@pytest.mark.parametrize("recipe", LOW_PRECISION)
def test_report_lists_every_block_linear_and_keeps_the_last_block_in_bf16(recipe):
    model = tiny_model()
    report = apply_recipe(model, recipe, bf16_last_layers=1)
    names = [layer["name"] for layer in report.layers]
    assert names == [f"layers.{i}.{lin}" for i in range(4) for lin in BLOCK_LINEARS] + ["lm_head",
                                                                                       "model.embed_tokens"]
    outside = report.layers[-2:]
    assert all(not layer["converted"] and "by convention" in layer["reason"] and layer["block"] is None
               for layer in outside)
    converted = {layer["name"] for layer in report.layers if layer["converted"]}
    expected = {f"layers.{i}.{lin}" for i in range(3) for lin in BLOCK_LINEARS}
    if recipe == "fp8_blockwise":  # k/v_proj are 128 -> 64 in the tiny model: not tileable by 128
        expected -= {f"layers.{i}.self_attn.{p}" for i in range(3) for p in ("k_proj", "v_proj")}
    assert converted == expected
    for layer in report.layers[:-2]:
        module = model.model.layers[layer["block"]].get_submodule(layer["name"].split(".", 2)[2])
        if layer["converted"]:
            assert layer["backend"] == "emulated" and isinstance(module, QuantizedLinear)
        else:
            assert type(module) is nn.Linear and layer["backend"] == "bf16" and layer["reason"]
    last_block = [layer for layer in report.layers if layer["block"] == 3]
    assert all("bf16_last_layers=1" in layer["reason"] for layer in last_block)
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert report.gemm_backend == "emulated"
    d = json.loads(json.dumps(report.to_dict()))
    assert d["bf16_last_layers"] == 1 and d["bf16_first_layers"] == 0 and d["recipe"] == recipe
    assert d["converted_layers"] == len(expected)


def test_blockwise_says_why_a_layer_is_skipped():
    report = apply_recipe(tiny_model(), "fp8_blockwise")
    k_proj = next(layer for layer in report.layers if layer["name"] == "layers.0.self_attn.k_proj")
    assert not k_proj["converted"]
    assert k_proj["reason"] == "out_features 64 not a multiple of 128 required by fp8_blockwise"


def test_bf16_first_layers_and_baseline_convert_nothing_they_should_not():
    report = apply_recipe(tiny_model(), "mxfp8", bf16_first_layers=2, bf16_last_layers=1)
    assert {layer["block"] for layer in report.layers if layer["converted"]} == {2}
    baseline = apply_recipe(tiny_model(), "bf16")
    assert baseline.gemm_backend == "bf16" and not any(layer["converted"] for layer in baseline.layers)
    assert baseline.hooks == [] and baseline.collect_numerics() == {}


@pytest.mark.parametrize("call,match", [
    (dict(name="fp6"), "unknown recipe 'fp6'; choose one of bf16, fp8_delayed"),
    (dict(name="nvfp4", hadamard=True), r"unknown option\(s\) hadamard for recipe 'nvfp4'; valid options: fused_quantize, fused_swiglu, rht, rht_seed"),
    (dict(name="fp8_tensorwise", amax_history_len=16),
     "valid options: fused_qkv_rope, fused_swiglu, implementation"),
    (dict(name="fp8_rowwise", amax_history_len=16), "valid options: none"),
    (dict(name="nvfp4", rht="yes"), "must be true or false"),
    (dict(name="mxfp8", scale_rounding="even"), "scale_rounding of mxfp8 must be one of floor, rceil"),
    (dict(name="fp8_delayed", amax_history_len=0), "positive integer"),
    (dict(name="mxfp8", backend="fast"), "unknown backend 'fast'"),
    (dict(name="mxfp8", bf16_first_layers=3, bf16_last_layers=2), "exceeds the model's 4 blocks"),
    (dict(name="mxfp8", bf16_last_layers=-1), "non-negative integer"),
])
def test_apply_recipe_rejects_bad_input_and_says_what_is_valid(call, match):
    with pytest.raises(ValueError, match=match):
        apply_recipe(tiny_model(), **call)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_real_backend_on_cpu_raises_and_says_why():
    with pytest.raises(ValueError, match="backend='real' is unavailable for fp8_tensorwise: FP8 tensor cores need a CUDA GPU"):
        apply_recipe(tiny_model(), "fp8_tensorwise", backend="real")
    with pytest.raises(ValueError, match="MXFP8 tensor cores need a CUDA GPU with compute capability sm_100"):
        apply_recipe(tiny_model(), "mxfp8", backend="real")


def test_converting_twice_is_refused():
    model = tiny_model()
    apply_recipe(model, "mxfp8")
    with pytest.raises(ValueError, match="already converted"):
        apply_recipe(model, "nvfp4")


def test_every_registered_recipe_takes_its_summary_options_and_capability_from_the_catalog():
    from training.precision import catalog
    from training.precision.registry import REGISTRY

    assert tuple(REGISTRY) == RECIPES == catalog.recipe_names()
    for name, recipe in REGISTRY.items():
        entry = catalog.get(name)
        assert recipe.summary == entry.summary and recipe.options == entry.defaults()
        assert recipe.min_capability == entry.real_min_capability
        assert entry.real_kernels and (entry.real_min_capability is None) == (name == catalog.BASELINE)


# ------------------------------------------------------------------------------ one linear vs FP32
# Relative Frobenius error of Y, dX and dW against the FP32 linear: E4M3/E5M2 keep 3/2 mantissa bits
# (~2-4% per element, averaged down by the GEMM); E2M1 keeps 1 (~10-20%).
TOLERANCE = {"fp8_delayed": 0.06, "fp8_tensorwise": 0.06, "fp8_rowwise": 0.06, "fp8_blockwise": 0.06,
             "mxfp8": 0.06, "nvfp4": 0.25}


def _linear_grads(module, x, dy):
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("recipe", LOW_PRECISION)
def test_converted_linear_forward_and_backward_match_fp32_within_format_tolerance(recipe):
    torch.manual_seed(0)
    reference = nn.Linear(128, 256, bias=False)
    holder = nn.Module()
    holder.model = nn.Module()
    holder.model.layers = nn.ModuleList([nn.Module()])
    holder.model.layers[0].proj = nn.Linear(128, 256, bias=False)
    holder.model.layers[0].proj.weight.data.copy_(reference.weight.data)
    report = apply_recipe(holder, recipe)
    assert report.layers[0]["converted"]
    converted = holder.model.layers[0].proj
    x, dy = torch.randn(3, 64, 128), torch.randn(3, 64, 256)
    y_ref, dx_ref, dw_ref = _linear_grads(reference, x, dy)
    y, dx, dw = _linear_grads(converted, x, dy)
    assert y.shape == y_ref.shape and dx.shape == dx_ref.shape and dw.dtype == torch.float32
    for what, ours, ref in (("Y", y, y_ref), ("dX", dx, dx_ref), ("dW", dw, dw_ref)):
        err = _rel(ours, ref)
        assert 1e-4 < err < TOLERANCE[recipe], f"{recipe} {what}: relative error {err:.4f}"


def test_converted_linear_with_bias_gets_the_exact_bias_gradient():
    lin = nn.Linear(64, 32)
    holder = nn.Module()
    holder.model = nn.Module()
    holder.model.layers = nn.ModuleList([nn.Module()])
    holder.model.layers[0].proj = lin
    apply_recipe(holder, "mxfp8")
    dy = torch.randn(5, 32)
    holder.model.layers[0].proj(torch.randn(5, 64)).backward(dy)
    assert torch.allclose(lin.bias.grad, dy.sum(0))


def test_nvfp4_ablation_options_change_what_they_say():
    def grads(**options):
        torch.manual_seed(0)
        holder = nn.Module()
        holder.model = nn.Module()
        holder.model.layers = nn.ModuleList([nn.Module()])
        holder.model.layers[0].proj = nn.Linear(64, 64, bias=False)
        apply_recipe(holder, "nvfp4", **options)
        g = torch.Generator().manual_seed(1)
        x, dy = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
        out = []
        for _ in range(2):
            _, dx, dw = _linear_grads(holder.model.layers[0].proj, x, dy)
            out.append((dx.clone(), dw.clone()))
            holder.model.layers[0].proj.weight.grad = None
        return out

    sr = grads()
    assert not torch.equal(sr[0][0], sr[1][0]), "stochastic rounding should make gradients vary"
    rne = grads(stochastic_rounding=False)
    assert torch.equal(rne[0][0], rne[1][0]) and torch.equal(rne[0][1], rne[1][1])
    no_rht = grads(stochastic_rounding=False, rht=False)
    assert torch.equal(no_rht[0][0], rne[0][0]), "RHT only touches Wgrad"
    assert not torch.equal(no_rht[0][1], rne[0][1])
    one_d = grads(stochastic_rounding=False, weight_2d=False)
    assert not torch.equal(one_d[0][0], rne[0][0])


def test_nvfp4_rht_operand_is_built_with_the_quantizer_and_never_stored_while_compiling():
    """The fused kernels' RHT operand exists on the layer's device before any step (built by the first compiled
    forward, it split that step into several graphs on the GPU: bench/NOTES_floor.md 86); for another device, a
    compiled function computes it inside its graph, in one graph, and stores nothing."""
    from training.precision.nvfp4 import NVFP4Quantizer
    from training.precision.nvfp4_triton import rht_operand

    q = NVFP4Quantizer(rht=True, stochastic_rounding=False, weight_2d=True, rht_seed=3, device=torch.device("cpu"))
    assert list(q._rht_operands) == ["cpu"]
    want = rht_operand(q.rht_matrix, "cpu")
    assert q.rht_operand(torch.device("cpu")) is q._rht_operands["cpu"] and torch.equal(q._rht_operands["cpu"], want)
    assert want.dtype == torch.bfloat16 and want.is_contiguous() and torch.equal(want.float(), q.rht_matrix.t())

    lazy = NVFP4Quantizer(rht=True, stochastic_rounding=False, weight_2d=True, rht_seed=3)  # no device given
    assert lazy._rht_operands == {}

    def f(x):
        return (x.to(torch.bfloat16) @ lazy.rht_operand(x.device)).float()

    torch._dynamo.reset()
    x = torch.randn(4, 16)
    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert torch.equal(torch.compile(f, fullgraph=True)(x), (x.to(torch.bfloat16) @ want).float())
    assert lazy._rht_operands == {}, "stored while compiling"
    lazy.rht_operand(torch.device("cpu"))  # eager: stored
    assert list(lazy._rht_operands) == ["cpu"]


# --------------------------------------------------------------------------------------- fp8_delayed
def _delayed_model(history: int = 4):
    model = tiny_model()
    report = apply_recipe(model, "fp8_delayed", amax_history_len=history)
    return model, report


def _train_steps(model, report, steps, seed=0, lr=1e-3):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, batch(seed + step))
        loss.backward()
        opt.step()
        for hook in report.hooks:
            hook.post_optimizer_step(model)
        losses.append(loss.item())
    return losses


def test_delayed_grad_amax_is_the_max_over_micro_batches_not_the_sum():
    from training.precision.fp8_delayed import GRAD, DelayedScalingHook
    layer = DelayedScalingLinear(nn.Linear(32, 16, bias=False), history_len=4, real=False)
    hook = DelayedScalingHook([("l", layer)], 4)
    assert all(p is not layer.grad_amax_token for p in layer.parameters())
    assert "grad_amax_token" not in layer.state_dict()
    x = torch.randn(8, 32)
    dys = [torch.randn(8, 16) * 3.0, torch.randn(8, 16) * 0.5]  # micro-batch 1 has the larger dY
    for i, dy in enumerate(dys):
        layer(x).backward(dy)
        assert float(layer.grad_amax_token.grad) == float(dy.abs().amax())
        if i < len(dys) - 1:
            hook.post_backward()  # what the train loop does between micro-batches
            assert layer.grad_amax_token.grad is None
    hook.post_optimizer_step()
    assert float(layer.amax_history[GRAD, 0]) == float(max(dy.abs().amax() for dy in dys))
    assert float(layer.pending_amax.abs().sum()) == 0.0 and layer.grad_amax_token.grad is None


def test_delayed_scale_at_step_t_comes_from_the_history_up_to_t_minus_1():
    layer = DelayedScalingLinear(nn.Linear(32, 32, bias=False), history_len=2, real=False)
    hook_model = nn.Module()
    from training.precision.fp8_delayed import DelayedScalingHook
    hook = DelayedScalingHook([("l", layer)], 2)

    def step(scale_x):
        x = torch.randn(16, 32) * scale_x
        layer(x.requires_grad_()).sum().backward()
        hook.post_optimizer_step(hook_model)
        return x.abs().amax()

    a1 = step(1.0)
    assert torch.allclose(layer.scales[0], 448.0 / a1) and bool(layer.history_ready)
    # Step 2 uses step 1's scale even though its input is 100x larger: it saturates.
    x2 = torch.randn(16, 32) * 100.0
    report_probe = layer.quantizer.input(x2, track=True)
    assert report_probe.saturated > 0
    assert torch.equal(report_probe.dequantize().abs().amax(), (448.0 / layer.scales[0]))
    a2 = step(100.0)
    assert torch.allclose(layer.scales[0], 448.0 / torch.maximum(a1, a2))
    a3 = step(1.0)  # history length 2: a1 drops out, a2 still dominates
    assert torch.allclose(layer.amax_history[0], torch.stack([a3, a2]))
    step(1.0)  # now a2 is gone too
    assert layer.scales[0] > 448.0 / a2 * 10
    # dY is E5M2: its scale uses 57344
    assert torch.allclose(layer.scales[2], 57344.0 / layer.amax_history[2].amax())


def test_delayed_scaling_state_round_trips_through_state_dict_and_a_checkpoint_file(tmp_path):
    model, report = _delayed_model()
    _train_steps(model, report, 3)
    (hook,) = report.hooks
    state = hook.state_dict()
    assert set(state["layers"]) == {layer["name"] for layer in report.layers if layer["converted"]}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    path = ckpt.save_checkpoint(tmp_path, 3, model=model, optimizer=opt, hooks=report.hooks)

    fresh, fresh_report = _delayed_model()
    (fresh_hook,) = fresh_report.hooks
    assert not torch.equal(fresh.model.layers[0].self_attn.q_proj.scales, model.model.layers[0].self_attn.q_proj.scales)
    ckpt.load_checkpoint(path, model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=1e-3),
                         hooks=fresh_report.hooks)
    for name, layer in hook.layers:
        other = dict(fresh_hook.layers)[name]
        for key in ("amax_history", "scales", "pending_amax", "history_ready"):
            assert torch.equal(getattr(layer, key), getattr(other, key)), (name, key)
        assert layer.ready_host and other.ready_host  # the host-side flag is restored with the history
    # Same state and weights => the resumed model computes exactly what the original does.
    with torch.no_grad():
        assert torch.equal(loss_of(model, batch(9)), loss_of(fresh, batch(9)))
    # HF weights stay plain: no amax buffers in the safetensors file.
    from safetensors.torch import load_file
    assert not any("amax" in k or "scales" in k for k in load_file(str(path / "model.safetensors")))


def test_delayed_state_from_another_configuration_is_rejected_with_a_fix():
    model, report = _delayed_model(history=4)
    _, other = _delayed_model(history=8)
    with pytest.raises(ValueError, match="amax_history_len=4, this run uses 8"):
        other.hooks[0].load_state_dict(report.hooks[0].state_dict())
    _, fewer = (lambda m: (m, apply_recipe(m, "fp8_delayed", amax_history_len=4, bf16_last_layers=1)))(tiny_model())
    with pytest.raises(ValueError, match="resume with the same bf16_first_layers/bf16_last_layers"):
        fewer.hooks[0].load_state_dict(report.hooks[0].state_dict())


def test_delayed_scaling_compiles_without_graph_breaks_and_matches_eager():
    torch._dynamo.reset()
    eager = DelayedScalingLinear(nn.Linear(32, 48, bias=False), history_len=4, real=False)
    compiled_layer = DelayedScalingLinear(nn.Linear(32, 48, bias=False), history_len=4, real=False)
    compiled_layer.weight.data.copy_(eager.weight.data)
    compiled = torch.compile(compiled_layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, 32)
    from torch._dynamo.utils import counters
    counters.clear()
    for step in range(3):
        # Step 1: just-in-time scales; from step 2 the history's, known on the host (one recompilation).
        assert compiled_layer.ready_host == (step > 0)
        outs = []
        for mod in (eager, compiled):
            xi = x.clone().requires_grad_()
            y = mod(xi)
            y.square().sum().backward()
            outs.append((y.detach(), xi.grad))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        eager.fold_grad_amax()
        compiled_layer.fold_grad_amax()
        assert torch.equal(eager.pending_amax, compiled_layer.pending_amax)
        eager.update_scales()
        compiled_layer.update_scales()
    assert bool(compiled_layer.history_ready) and compiled_layer.amax_history[2, 0] > 0
    assert counters["stats"]["unique_graphs"] == 2  # one graph per value of ready_host, not one per step


# ------------------------------------------------------------------------------------------ numerics
STATS = ("amax_input", "amax_weight", "amax_grad", "underflow_frac", "saturation_frac", "snr_db")


@pytest.mark.parametrize("recipe", LOW_PRECISION)
def test_numerics_are_reported_per_converted_layer_only_while_sampling(recipe):
    model = tiny_model()
    report = apply_recipe(model, recipe, bf16_last_layers=1)
    report.set_numerics_sampling(True)
    loss_of(model, batch()).backward()
    stats = report.collect_numerics()
    report.set_numerics_sampling(False)
    converted = [layer["name"] for layer in report.layers if layer["converted"]]
    for name in converted:
        for stat in STATS:
            value = stats[f"numerics/{name}/{stat}"]
            assert isinstance(value, float) and value == value and abs(value) != float("inf")
        assert 0.0 <= stats[f"numerics/{name}/underflow_frac"] <= 1.0
        snr = stats[f"numerics/{name}/snr_db"]
        assert (5.0 < snr < 60.0), (name, snr)  # FP4 ~ 10-20 dB, FP8 ~ 25-35 dB
    assert not any("layers.3." in key for key in stats)
    # Off: no hooks anywhere, nothing collected.
    assert all(not m._forward_hooks for m in model.modules())
    loss_of(model, batch()).backward()
    assert report.collect_numerics() == {}


def test_numerics_see_flush_to_zero_and_nvfp4_is_noisier_than_mxfp8():
    snrs = {}
    for recipe in ("mxfp8", "nvfp4"):
        model = tiny_model()
        report = apply_recipe(model, recipe)
        report.set_numerics_sampling(True)
        loss_of(model, batch()).backward()
        stats = report.collect_numerics()
        report.set_numerics_sampling(False)
        snrs[recipe] = stats["numerics/layers.0.mlp.up_proj/snr_db"]
        if recipe == "nvfp4":
            # E2M1 has nothing between 0 and 0.5 x block scale: small elements flush to zero.
            assert stats["numerics/layers.0.mlp.up_proj/underflow_frac"] > 0.01
    assert snrs["mxfp8"] > snrs["nvfp4"] + 6.0


# ----------------------------------------------------------------------------------- a short training
def test_first_step_loss_of_every_recipe_equals_bf16_up_to_quantization_error():
    ids = batch(3)
    with torch.no_grad():
        base = loss_of(tiny_model(), ids).item()
        for recipe in LOW_PRECISION:
            model = tiny_model()
            apply_recipe(model, recipe)
            loss = loss_of(model, ids).item()
            tol = 0.02 if recipe == "nvfp4" else 0.005
            assert abs(loss - base) / base < tol, (recipe, loss, base)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_few_training_steps_reduce_the_loss_like_bf16(recipe):
    torch.manual_seed(0)
    model = tiny_model()
    report = apply_recipe(model, recipe, bf16_last_layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = batch(5, size=8)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        for hook in report.hooks:
            hook.post_optimizer_step(model)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


def test_delayed_real_scaled_mm_path_agrees_with_its_emulation():
    # torch._scaled_mm also runs on CPU in this torch, so the GPU code path (operand layouts, E4M3/E5M2,
    # reciprocal scales) is checked here against the emulation with the same delayed scales.
    torch.manual_seed(0)
    real = DelayedScalingLinear(nn.Linear(64, 48, bias=True), history_len=4, real=True)
    emul = DelayedScalingLinear(nn.Linear(64, 48, bias=True), history_len=4, real=False)
    emul.load_state_dict(real.state_dict())
    for step in range(3):
        x = torch.randn(2, 16, 64) * (1 + step)
        dy = torch.randn(2, 16, 48)
        outs = []
        for layer in (real, emul):
            layer.weight.grad = layer.bias.grad = None
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.backward(dy)
            outs.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
            layer.update_scales()
        for what, a, b in zip(("Y", "dX", "dW", "db"), *outs):
            # The real path rounds Y and dX to BF16 like the GPU kernels; the emulation keeps FP32.
            assert _rel(a, b) < 1e-2, (step, what, _rel(a, b))
        assert torch.equal(real.amax_history, emul.amax_history)


def test_delayed_real_path_compiles_into_one_graph_and_matches_eager():
    # The torch._scaled_mm path, inductor, fullgraph: the backward's amax record (custom op with a declared
    # mutation) lands in the buffer, and the numbers are eager's.
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = DelayedScalingLinear(nn.Linear(64, 48, bias=False), history_len=4, real=True)
    twin = DelayedScalingLinear(nn.Linear(64, 48, bias=False), history_len=4, real=True)
    twin.load_state_dict(layer.state_dict())
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    for step in range(2):
        x, dy = torch.randn(32, 64) * (step + 1), torch.randn(32, 48)
        outs = []
        for module, weight in ((compiled, layer.weight), (twin, twin.weight)):
            weight.grad = None
            xi = x.clone().requires_grad_()
            y = module(xi)
            y.backward(dy)
            outs.append((y.detach(), xi.grad, weight.grad))
        for what, a, b in zip(("Y", "dX", "dW"), *outs):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (step, what)
        layer.fold_grad_amax()
        twin.fold_grad_amax()
        assert torch.equal(layer.pending_amax, twin.pending_amax) and layer.pending_amax[2] > 0
        layer.update_scales()
        twin.update_scales()
    assert torch.equal(layer.scales, twin.scales)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_delayed_one_pass_cast_keeps_every_bit(compiled):
    # one_pass_cast changes how the amax and the transposed FP8 layouts are computed (the real torch._scaled_mm
    # path, which runs on CPU too), not their values: Y, dX, dW, history and scales equal the layer without it.
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = DelayedScalingLinear(nn.Linear(64, 48, bias=False), history_len=4, real=True, one_pass_cast=False)
    other = DelayedScalingLinear(nn.Linear(64, 48, bias=False), history_len=4, real=True, one_pass_cast=True)
    other.load_state_dict(base.state_dict())
    run = [torch.compile(m, backend="inductor", fullgraph=True) if compiled else m for m in (base, other)]
    for step in range(3):
        x, dy = torch.randn(32, 64) * (step + 1), torch.randn(32, 48)
        outs = []
        for module, layer in zip(run, (base, other)):
            layer.weight.grad = None
            xi = x.clone().requires_grad_()
            y = module(xi)
            y.backward(dy)
            outs.append((y.detach(), xi.grad, layer.weight.grad))
            layer.update_scales()
        for what, a, b in zip(("Y", "dX", "dW"), *outs):
            assert torch.equal(a, b), (step, what)
        assert torch.equal(base.amax_history, other.amax_history) and base.amax_history[:, 0].gt(0).all()
        assert torch.equal(base.scales, other.scales)


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise"])
def test_emulation_matches_torchao_float8_linear_which_also_runs_on_cpu(recipe):
    # The real-kernel module (torchao Float8Linear over torch._scaled_mm) runs on CPU too: our emulation
    # of the same recipe must reproduce it, Fprop, Dgrad and Wgrad.
    from training.precision.registry import REGISTRY

    g = torch.Generator().manual_seed(0)
    weight, x0, dy = torch.randn(96, 128, generator=g) * 0.05, torch.randn(4, 32, 128, generator=g) * 3, \
        torch.randn(4, 32, 96, generator=g)
    results = []
    for real in (True, False):
        lin = nn.Linear(128, 96, bias=False)
        lin.weight.data.copy_(weight)
        module, _, how = REGISTRY[recipe].convert(lin, "proj", {}, real)
        assert ("torchao" in how) == real
        x = x0.clone().requires_grad_()
        try:
            y = module(x)
        except RuntimeError as exc:  # torch 2.11's CPU _scaled_mm takes per-tensor scales only (2.13 takes rows)
            if real and "per-tensor scaling for CPU" in str(exc):
                pytest.skip(f"the reference cannot run here: torch {torch.__version__}'s CPU _scaled_mm has no "
                            f"rowwise scales")
            raise
        y.backward(dy)
        results.append((y.detach(), x.grad, lin.weight.grad))
    for what, a, b in zip(("Y", "dX", "dW"), *results):
        # Same quantized operands; only the GEMM's output rounding differs (torchao's rowwise GEMM
        # returns BF16-rounded values, 2^-9 relative) -- an order of magnitude below FP8's own error.
        assert _rel(a, b) < 4e-3, (recipe, what, _rel(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mxfp8_emulation_equals_torchao_mxfp8_linear_emulated_mode_exactly(dtype):
    # torchao's own MXFP8 training linear has a hardware-agnostic EMULATED mode: our Fprop, Dgrad and
    # Wgrad (operand formats and block orientations) must give the same numbers, bit for bit.
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    from training.precision.registry import REGISTRY

    g = torch.Generator().manual_seed(0)
    weight, x0, dy = torch.randn(96, 128, generator=g) * 0.05, torch.randn(64, 128, generator=g), \
        torch.randn(64, 96, generator=g)
    theirs = MXFP8Linear(128, 96, bias=False, kernel_preference=KernelPreference.EMULATED,
                         scale_calculation_mode=ScaleCalculationMode.RCEIL).to(dtype)
    lin = nn.Linear(128, 96, bias=False).to(dtype)
    with torch.no_grad():
        theirs.weight.copy_(weight)
        lin.weight.copy_(weight)
    recipe = REGISTRY["mxfp8"]
    ours, _, _ = recipe.convert(lin, "proj", recipe.resolve_options({"scale_rounding": "rceil"}), False)
    results = []
    for module in (theirs, ours):
        x = x0.to(dtype).requires_grad_()
        y = module(x)
        y.backward(dy.to(dtype))
        results.append((y, x.grad, module.weight.grad))
    for what, a, b in zip(("Y", "dX", "dW"), *results):
        assert torch.equal(a, b), what


def test_delayed_amax_is_max_reduced_across_data_parallel_ranks(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    mp.spawn(_delayed_ddp_worker, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)
    scales = [torch.load(tmp_path / f"scales{r}.pt") for r in range(2)]
    assert torch.equal(scales[0], scales[1])
    assert not dist.is_initialized()


def _delayed_ddp_worker(rank, world, init_file):
    import torch.distributed as dist

    from training.precision.fp8_delayed import DelayedScalingHook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        layer = DelayedScalingLinear(nn.Linear(16, 16, bias=False), history_len=4, real=False)
        hook = DelayedScalingHook([("l", layer)], 4)
        x = torch.randn(8, 16) * (10.0 if rank == 1 else 1.0)  # rank 1 sees larger activations
        layer(x.requires_grad_()).sum().backward()
        hook.post_optimizer_step()
        torch.save(layer.scales.clone(), f"{init_file.rsplit('/', 1)[0]}/scales{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_blockwise_quick_autotune_keeps_8_of_torchaos_45_quantizer_configs(monkeypatch):
    pytest.importorskip("triton")
    from torchao.prototype.blockwise_fp8_training import kernels
    from training.precision.fp8_blockwise import apply_autotune_policy

    tuner = kernels.triton_fp8_blockwise_act_quant_lhs_kernel
    gemm = kernels.triton_fp8_gemm_1x128_128x128_kernel
    saved_gemm = list(gemm.configs)
    saved = {name: list(getattr(kernels, name).configs) for name in dir(kernels)
             if hasattr(getattr(kernels, name), "configs")}
    try:
        monkeypatch.delenv("PLAB_BLOCKWISE_AUTOTUNE", raising=False)
        assert apply_autotune_policy() is None and len(tuner.configs) == 45
        monkeypatch.setenv("PLAB_BLOCKWISE_AUTOTUNE", "quick")
        assert apply_autotune_policy() == 8
        assert {c.kwargs["NUM_GROUPS"] for c in tuner.configs} == {16, 64}
        assert gemm.configs == saved_gemm  # the GEMMs keep every config
    finally:
        for name, configs in saved.items():
            getattr(kernels, name).configs = configs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tensorwise_plab_linear_gives_torchaos_float8_linear_every_bit(dtype, bias, compiled):
    # fp8_tensorwise's `implementation: plab` is the same recipe as torchao's tensorwise Float8Linear, with other
    # data movement (backward reuses the forward's FP8 codes): torch._scaled_mm runs on CPU too, so Y, dX, dW and
    # db of the real paths must be equal to the bit, eagerly and compiled, over steps with different amaxes.
    from tests.precision.tensorwise_checks import train_both_implementations

    torch._dynamo.reset()
    torch.manual_seed(0)
    compile_fn = (lambda m: torch.compile(m, backend="inductor", fullgraph=True)) if compiled else None
    results = train_both_implementations(nn.Linear(128, 96, bias=bias).to(dtype), (4, 32, 128), compile_fn)
    for step, (want, got) in enumerate(zip(*results)):
        for what, a, b in zip(("Y", "dX", "dW", "db"), want, got):
            assert a.abs().sum() > 0 and a.dtype == b.dtype, (step, what)
            assert torch.equal(a, b), (step, what, (a.float() - b.float()).abs().max().item())


@pytest.mark.parametrize("implementation, fsdp, real, want", [
    ("auto", False, True, "CurrentScalingLinear"), ("auto", True, True, "Float8Linear"),
    ("plab", True, True, "CurrentScalingLinear"), ("torchao", False, True, "Float8Linear"),
    ("auto", False, False, "QuantizedLinear"), ("plab", False, False, "QuantizedLinear"),
])
def test_tensorwise_implementation_auto_is_plab_except_under_fsdp2_and_emulation_keeps_the_oracle(
        implementation, fsdp, real, want):
    # auto: our linear where the real kernels run, torchao's under FSDP2 (its FP8 all-gather); emulated GEMMs keep
    # the emulation (QuantizedLinear with the tensorwise quantizer) whatever the option says.
    from training.precision.registry import get_recipe

    module, _, how = get_recipe("fp8_tensorwise").convert(nn.Linear(64, 32), "proj",
                                                          {"implementation": implementation, "fsdp": fsdp}, real)
    assert type(module).__name__ == want, how
    assert ("FP8 all-gather" in how) == (want == "Float8Linear" and fsdp)
