"""Quantized weights reused across the micro-batches of a step (training.precision.weight_reuse): the same bits as
quantizing them in every micro-batch, each weight quantized once per optimizer step, and only where that holds."""
from __future__ import annotations

import pytest

from training.config import RunSpec, SpecError
from training.precision.weight_reuse import reuse_applies
from training.sink import ListSink
from training.train import train

KEYS = ("train/loss", "train/grad_norm", "val/loss")


def run(make_spec, cache_dir, recipe: str, reuse: bool, **training):
    spec = make_spec(recipe=recipe, training={"steps": 4, "grad_accum": 2, "val_every": 2, "val_batches": 1,
                                              "perf": {"reuse_quantized_weights": reuse}, **training})
    sink = ListSink()
    result = train(spec, sink, cache_dir=cache_dir)
    assert result.status == "succeeded"
    info = sink.events_of("run_info")[0]
    return {k: [float(v).hex() for _, v in sink.series(k)] for k in KEYS}, info


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise"])
def test_reused_weights_give_the_bits_of_quantizing_them_in_every_micro_batch(make_spec, cache_dir, recipe):
    with_reuse, info = run(make_spec, cache_dir, recipe, True)
    without, info_off = run(make_spec, cache_dir, recipe, False)
    assert info["reuse_quantized_weights"] is True and info_off["reuse_quantized_weights"] is False
    assert with_reuse == without
    assert len(with_reuse["train/loss"]) == 4 and len(with_reuse["val/loss"]) == 2


def test_each_weight_is_quantized_once_per_step_and_after_every_optimizer_step(make_spec, cache_dir, monkeypatch):
    from training.precision.mxfp8 import MXFP8Quantizer

    calls = {"n": 0}
    original = MXFP8Quantizer.weight_fprop

    def counted(self, w, **kw):
        calls["n"] += 1
        return original(self, w, **kw)

    monkeypatch.setattr(MXFP8Quantizer, "weight_fprop", counted)
    _, info = run(make_spec, cache_dir, "mxfp8", False, val_every=0, val_batches=0)
    per_run_without = calls["n"]
    calls["n"] = 0
    _, info = run(make_spec, cache_dir, "mxfp8", True, val_every=0, val_batches=0)
    from training.model import llama_config
    linears = 7 * llama_config("tiny", 512, 32).num_hidden_layers  # q, k, v, o, gate, up, down per block
    assert per_run_without == 4 * 2 * linears  # steps x micro-batches x linears
    assert calls["n"] == 4 * linears  # once per step


def _block_steps(recipe: str, reuse: bool, *, compiled: bool, steps: int = 3, device: str = "cpu", dtype=None):
    """A one-linear decoder block converted by `recipe` (its forward compiled as training compiles layers, when
    `compiled`); per step two micro-batches (forward + backward), then an optimizer-like update of W. Returns the
    outputs and gradients of every micro-batch, the number of graphs Dynamo had made after the first step and at
    the end, and with reuse (linears cached, blocks refreshed, the cache's path)."""
    import torch
    import torch._dynamo
    from torch import nn
    from torch._dynamo.utils import counters

    from training.precision import apply_recipe
    from training.precision.weight_reuse import QuantizedWeightReuse

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    holder = nn.Module()
    holder.model = nn.Module()
    block = nn.Module()
    block.proj = nn.Linear(64, 96, bias=False).to(device=device, dtype=dtype or torch.float32)
    block.forward = lambda x: block.proj(x)
    holder.model.layers = nn.ModuleList([block])
    apply_recipe(holder, recipe)
    if compiled:
        block.forward = torch.compile(block.forward)
    hooks = QuantizedWeightReuse([block], compiled=compiled) if reuse else None
    out = []
    for step in range(steps):
        for micro in range(2):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * step + micro))
            x = x.to(device=device, dtype=block.proj.weight.dtype).requires_grad_()
            y = block(x)
            y.backward(torch.ones_like(y) / y.numel())
            out += [y.detach(), x.grad]
        out.append(block.proj.weight.grad)
        with torch.no_grad():
            block.proj.weight.sub_(0.5 * block.proj.weight.grad)
        block.proj.weight.grad = None
        if hooks is not None:
            hooks.post_optimizer_step()
        if step == 0:
            first = counters["stats"]["unique_graphs"]
    graphs = (first, counters["stats"]["unique_graphs"])
    cached = block.proj.cached_weight
    return out, graphs, (hooks.linears, hooks.refreshes, cached and cached[0]) if hooks else None


def same(a: list, b: list) -> bool:
    import torch
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_an_eager_block_reuses_its_quantized_weight_with_the_same_bits(recipe):
    reused, _, (linears, refreshes, path) = _block_steps(recipe, True, compiled=False)
    fresh, _, _ = _block_steps(recipe, False, compiled=False)
    assert (linears, refreshes, path) == (1, 3, "generic")  # once per step, after each update; torch quantizers
    assert same(reused, fresh)


def test_a_compiled_block_with_the_torch_quantizers_keeps_quantizing_in_its_graph():
    # Inductor's bits for W would need a compiled call per linear (see QuantizedLinear.reuses_weight_when).
    reused, graphs, (linears, refreshes, path) = _block_steps("mxfp8", True, compiled=True)
    fresh, _, _ = _block_steps("mxfp8", False, compiled=True)
    assert (linears, refreshes, path) == (0, 0, None)
    assert same(reused, fresh) and graphs == (1, 1)


def test_delayed_scaling_and_single_micro_batches_do_not_reuse(make_spec, cache_dir):
    _, info = run(make_spec, cache_dir, "fp8_delayed", True)
    assert info["reuse_quantized_weights"] is False  # its weight scale follows a per-micro-batch history
    _, info = run(make_spec, cache_dir, "mxfp8", True, grad_accum=1)
    assert info["reuse_quantized_weights"] is False
    _, info = run(make_spec, cache_dir, "bf16", True)
    assert info["reuse_quantized_weights"] is False  # nothing quantized


def test_where_reuse_applies():
    assert reuse_applies(2, "single", True) is None and reuse_applies(4, "ddp", True) is None
    assert "one micro-batch" in reuse_applies(1, "single", True)
    assert "FSDP2" in reuse_applies(2, "fsdp", True)
    assert "off" in reuse_applies(2, "single", False)


def test_the_option_is_validated(make_spec):
    with pytest.raises(SpecError, match="reuse_quantized_weights"):
        RunSpec.from_dict(make_spec(training={"perf": {"reuse_quantized_weights": "yes"}}), check_paths=False)


def test_moving_a_module_drops_its_cached_weight():
    import torch
    from torch import nn

    from training.precision import apply_recipe
    from training.precision.weight_reuse import QuantizedWeightReuse

    holder = nn.Module()
    holder.model = nn.Module()
    block = nn.Module()
    block.proj = nn.Linear(64, 32, bias=False)
    block.forward = lambda x: block.proj(x)
    holder.model.layers = nn.ModuleList([block])
    apply_recipe(holder, "mxfp8")
    QuantizedWeightReuse([block])
    x = torch.randn(4, 64)
    block(x)
    assert block.proj.cached_weight is not None
    holder.to(torch.float64)
    assert block.proj.cached_weight is None
    assert block(x.double()).dtype == torch.float64  # quantizes the moved weight itself
