"""training.perf.rope_backward: RoPE's backward on the fused QKV projection's output as one pass (training.rope_triton,
QKVRoPEFn) or left to the compiler. On a CPU the pass is its torch reference (the Triton kernel is checked against that
reference under Triton's interpreter, tests/precision/fp8_rope_interp_checks.py, and against inductor's compiled
step on a GPU, tests/training/test_rope_backward_gpu.py)."""
import copy

import pytest
import torch

from tests.precision.test_fused_swiglu import ApplySpy
from training.config import PerfOptions, RunSpec, SpecError
from training.model import build_model, fuse_qkv, llama_config, set_rope_backward
from training.rope_triton import QKVRoPEFn, qkv_rope_applies, rope_bwd_reference, split_qkv_rope

BASE = {"recipe": "bf16", "model": "tiny", "data": {"corpus": "random", "vocab_size": 512, "seq_len": 64},
        "training": {"steps": 3, "warmup_steps": 0, "batch_size": 4, "val_every": 0}, "seed": 0}


def _spec(perf: dict, recipe: str = "bf16") -> dict:
    return {**BASE, "recipe": recipe, "training": {**BASE["training"], "perf": perf}}


def _model(hidden=64, heads=4, kv_heads=2, dtype=torch.float32):
    config = llama_config({"hidden_size": hidden, "intermediate_size": 96, "num_hidden_layers": 2,
                           "num_attention_heads": heads, "num_key_value_heads": kv_heads}, 97, 32)
    model = build_model(config, 3).to(dtype)
    fuse_qkv(model)
    return model


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return [logits.detach()] + [p.grad.clone() for p in model.parameters()]


def test_the_spec_takes_the_three_values_and_the_schema_lists_them():
    from backend.spec_schema import training_schema
    assert RunSpec.from_dict(BASE).training.perf.rope_backward == "auto"
    for value in PerfOptions.ROPE_BACKWARDS:
        assert RunSpec.from_dict(_spec({"rope_backward": value})).training.perf.rope_backward == value
    with pytest.raises(SpecError, match=r"training.perf.rope_backward must be one of "
                                        r"\['auto', 'one_pass', 'compiled'\], got 'triton'"):
        RunSpec.from_dict(_spec({"rope_backward": "triton"}))
    with pytest.raises(SpecError, match="rope_backward: one_pass .*fuse_qkv is false; set fuse_qkv to true"):
        RunSpec.from_dict(_spec({"rope_backward": "one_pass", "fuse_qkv": False}))
    assert training_schema()["properties"]["perf"]["properties"]["rope_backward"] == {
        "enum": ["auto", "one_pass", "compiled"]}


def test_one_pass_gives_the_same_values_and_gradients_eagerly_in_fp32(monkeypatch):
    base = _model()
    one = copy.deepcopy(base)
    assert set_rope_backward(base, "compiled", on_cuda=False) == "compiled"
    assert set_rope_backward(one, "one_pass", on_cuda=False) == "one_pass"
    spy = ApplySpy(monkeypatch, QKVRoPEFn)
    for step in range(2):
        ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(step))
        want, got = _step(base, ids), _step(one, ids)
        for i, (a, b) in enumerate(zip(want, got)):
            assert b.abs().sum() > 0 and torch.equal(a, b), f"step {step}: tensor {i}"
    assert spy.calls == 2 * 2   # two blocks, two steps: the one-pass path ran


def test_compiled_in_bf16_the_one_pass_gradient_is_inductors_to_the_bit():
    """The backward's dY = [RoPE⁻¹(dQ) | RoPE⁻¹(dK) | dV] in BF16: inductor's compiled autograd of HF's RoPE (FP32
    inside, one rounding) against QKVRoPEFn's pass (the reference on a CPU), fed the same BF16 gradients."""
    torch._dynamo.reset()
    batch, tokens, n_q, n_kv, d = 2, 24, 4, 2, 32
    gen = torch.Generator().manual_seed(0)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.arange(tokens).float()[:, None] * inv
    emb = torch.cat([emb, emb], dim=-1)[None]
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()

    split = [n_q * d, n_kv * d, n_kv * d]
    grads = [(torch.randn(batch, h, tokens, d, generator=gen) * 3).bfloat16() for h in (n_q, n_kv, n_kv)]
    y0 = torch.randn(batch, tokens, (n_q + 2 * n_kv) * d, generator=gen).bfloat16()
    assert qkv_rope_applies(y0, cos, sin, d)   # the one_pass branch takes QKVRoPEFn
    results = []
    for one_pass in (False, True):
        y = y0.clone().requires_grad_()
        out = torch.compile(lambda t, o=one_pass: split_qkv_rope(t, cos, sin, split, d, o))(y)
        torch.autograd.backward(out, grads)
        results.append(([t.detach() for t in out], y.grad))
    (out_a, dy_a), (out_b, dy_b) = results
    assert all(torch.equal(a, b) for a, b in zip(out_a, out_b))
    assert dy_b.abs().sum() > 0 and torch.equal(dy_a, dy_b)
    rows = lambda g: g.transpose(1, 2)  # noqa: E731
    assert torch.equal(dy_b.reshape(batch * tokens, -1), rope_bwd_reference(*(rows(g) for g in grads), cos, sin))


def test_auto_is_one_pass_on_a_gpu_where_it_keeps_the_compiled_paths_values():
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from training.precision.fp8_delayed import DelayedScalingLinear
    from training.precision.mxfp8 import MXFP8EmulatedLinear, MXFP8Quantizer
    from training.precision.nvfp4 import NVFP4EmulatedLinear, NVFP4Quantizer

    model = build_model(llama_config({"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 5,
                                      "num_attention_heads": 4, "num_key_value_heads": 2}, 97, 32), 3)
    fuse_qkv(model)
    assert set_rope_backward(model, "auto", on_cuda=False) == "compiled"   # the CPU: inductor's kernel
    assert set_rope_backward(model, "auto", on_cuda=True) == "one_pass"    # torch's linear (bf16)
    attns = [layer.self_attn for layer in model.model.layers]
    # dY cast to FP8 by a kernel inductor fuses RoPE's backward into: torchao's tensorwise linear, fp8_delayed's
    attns[1].qkv_proj = Float8Linear.from_float(attns[1].qkv_proj,
                                                config=Float8LinearConfig.from_recipe_name("tensorwise"))
    attns[2].qkv_proj = DelayedScalingLinear(attns[2].qkv_proj, history_len=4, real=False)
    # the GEMM's per-tensor scale, an epilogue inductor fuses into RoPE's forward (nvfp4's first loss moved)
    attns[3].qkv_proj = NVFP4EmulatedLinear(attns[3].qkv_proj, NVFP4Quantizer(
        rht=True, stochastic_rounding=True, weight_2d=True, rht_seed=0), "nvfp4")
    # MXFP8's emulated linear reads dY as BF16 in its own Triton quantizer, and hands its output to RoPE as written
    attns[4].qkv_proj = MXFP8EmulatedLinear(attns[4].qkv_proj, MXFP8Quantizer("rceil"), "mxfp8")
    assert set_rope_backward(model, "auto", on_cuda=True) == "one_pass on 2 of 5 blocks"
    assert [a.rope_one_pass for a in attns] == [True, False, False, False, True]
    assert set_rope_backward(model, "one_pass", on_cuda=True) == "one_pass"   # asked for: every block
    unfused = build_model(llama_config("tiny", 97, 32), 3)
    assert set_rope_backward(unfused, "one_pass", on_cuda=True) is None


def test_a_run_records_what_held_and_one_pass_without_a_fused_projection_is_refused():
    from training.sink import ListSink
    from training.train import train

    losses = {}
    for perf in ({"fuse_qkv": True}, {"fuse_qkv": True, "rope_backward": "one_pass"}, {}):
        sink = ListSink()
        result = train(_spec(perf), sink)
        assert result.status == "succeeded", result
        losses[result.summary["rope_backward"]] = [v for _, v in sink.series("train/loss")]
    assert set(losses) == {"compiled", "one_pass", None}   # auto on a CPU: compiled; None: no fused projection
    assert losses["one_pass"] == losses["compiled"]   # FP32 on a CPU: the same values
    with pytest.raises(SpecError, match="rope_backward: one_pass .* set training.perf.fuse_qkv to true"):
        train(_spec({"rope_backward": "one_pass"}), ListSink())
