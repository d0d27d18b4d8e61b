"""Presets, deterministic initialisation and the fused loss."""
import pytest
import torch

from training.model import PRESETS, CausalLMLoss, build_model, count_parameters, llama_config


def test_1b_preset_is_the_114b_anchor_shape():
    cfg = llama_config("1b", vocab_size=32000, seq_len=2048)   # the anchor's vocabulary
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (2048, 8192, 16)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (16, 8, 32000)
    assert cfg.tie_word_embeddings is False and cfg._attn_implementation == "sdpa"
    with torch.device("meta"):
        from transformers import LlamaForCausalLM
        n = count_parameters(LlamaForCausalLM(cfg))
    assert 1.13e9 < n < 1.15e9


@pytest.mark.parametrize("name", ["tiny", "125m", "350m", "1b"])
def test_preset_linear_dims_tile_quantisation_blocks(name):
    p = PRESETS[name]
    head_dim = p["hidden_size"] // p["num_attention_heads"]
    for dim in (p["hidden_size"], p["intermediate_size"], p["num_key_value_heads"] * head_dim):
        assert dim % 32 == 0


def test_same_seed_gives_identical_weights_and_another_seed_does_not():
    cfg = llama_config("tiny", 512, 32)
    a, b, c = build_model(cfg, 3), build_model(cfg, 3), build_model(cfg, 4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)
    assert a.lm_head.weight.data_ptr() != a.model.embed_tokens.weight.data_ptr()  # untied


def test_building_a_model_does_not_consume_the_callers_random_stream():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(llama_config("tiny", 512, 32), 0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("weight_grad", ["one_gemm", "per_chunk"])
def test_fused_chunked_loss_equals_standard_cross_entropy_in_value_and_gradients(weight_grad):
    cfg = llama_config("tiny", 512, 32)
    model = build_model(cfg, 0)
    batch = torch.randint(0, 512, (3, 33), generator=torch.Generator().manual_seed(0))
    grads = {}
    for fused in (False, True):
        model.zero_grad()
        loss = CausalLMLoss(model, fused_loss=fused, chunk_tokens=40, weight_grad=weight_grad)(batch[:, :-1],
                                                                                              batch[:, 1:])
        loss.backward()
        grads[fused] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    assert torch.allclose(grads[True][0], grads[False][0], atol=1e-6)
    for g_fused, g_std in zip(grads[True][1], grads[False][1]):
        assert torch.allclose(g_fused, g_std, atol=1e-6, rtol=1e-4)
    logits = model(input_ids=batch[:, :-1]).logits   # the plain HF forward as the reference
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    assert torch.allclose(reference, grads[False][0], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_chunk_gives_the_scatter_add_formulation_bit_for_bit(dtype):
    # _ce_chunk's gradient as one select (p - 1 at the target) against the softmax with -1 scatter-added at the
    # target, which it replaced: loss, dL/dh and the accumulated dL/dW equal to the bit, eagerly and compiled (each
    # against the same mode: inductor's exp and reductions differ from eager's in the last bit either way).
    from training.model import _ce_chunk

    def scattered(hc, w, tc, grad_w):
        logits = (hc @ w.t()).float()
        lse = torch.logsumexp(logits, dim=-1)
        loss = (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
        g = torch.exp(logits - lse[:, None])
        g = g.scatter_add(1, tc[:, None], torch.full_like(lse[:, None], -1.0)).to(hc.dtype)
        return loss, g @ w, grad_w + (g.t() @ hc).float()

    gen = torch.Generator().manual_seed(0)
    hc, w = torch.randn(48, 64, generator=gen).to(dtype), (torch.randn(300, 64, generator=gen) * 0.3).to(dtype)
    tc, acc = torch.randint(0, 300, (48,), generator=gen), torch.randn(300, 64, generator=gen)
    for compile_ in (lambda f: f, lambda f: torch.compile(f, dynamic=False)):
        for a, b in zip(compile_(_ce_chunk)(hc, w, tc, acc), compile_(scattered)(hc, w, tc, acc)):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_gemm_chunk_gives_the_per_chunk_loss_and_hidden_gradient_bit_for_bit(dtype):
    # `_ce_chunk_into` (weight_grad one_gemm) writes dL/dlogits into its rows of the caller's buffer and returns the
    # loss; the caller's g @ w is dL/dh. Against `_ce_chunk`: the same loss, dL/dh and dL/dlogits to the bit, eagerly
    # and compiled (each against the same mode), and the rows outside the chunk untouched.
    from training.model import _ce_chunk, _ce_chunk_into

    def gradient_out(hc, w, tc, grad_w):   # _ce_chunk's dL/dlogits, recovered from its weight gradient's input
        logits = (hc @ w.t()).float()
        p = torch.exp(logits - torch.logsumexp(logits, dim=-1)[:, None])
        return torch.where(torch.arange(w.shape[0])[None, :] == tc[:, None], p - 1.0, p).to(hc.dtype)

    gen = torch.Generator().manual_seed(1)
    hc, w = torch.randn(48, 64, generator=gen).to(dtype), (torch.randn(300, 64, generator=gen) * 0.3).to(dtype)
    tc, acc = torch.randint(0, 300, (48,), generator=gen), torch.zeros(300, 64)
    for compile_ in (lambda f: f, lambda f: torch.compile(f, dynamic=False)):
        buf = torch.full((96, 300), 7.0, dtype=dtype)
        loss = compile_(_ce_chunk_into)(hc, w, tc, buf[48:])
        ref_loss, ref_gh, ref_gw = compile_(_ce_chunk)(hc, w, tc, acc)
        assert torch.equal(loss, ref_loss) and torch.equal(buf[48:] @ w, ref_gh)
        assert torch.equal(buf[:48], torch.full((48, 300), 7.0, dtype=dtype))
        assert torch.equal(buf[48:], compile_(gradient_out)(hc, w, tc, acc))
        assert torch.equal((buf[48:].t() @ hc).float(), ref_gw)   # one chunk: the same GEMM either way


def test_the_one_gemm_weight_gradient_rounds_once_and_is_closer_to_exact_than_per_chunk():
    # BF16 weights (the GPU runs' parameter dtype): per_chunk rounds each chunk's dL/dW to BF16, sums in FP32 and
    # rounds again; one_gemm accumulates every token in one GEMM and rounds once, as the unfused backward does. Its
    # error against an FP64 evaluation of the same BF16 dL/dlogits is smaller over all 300 x 64 entries.
    from training.model import _ChunkedLinearCrossEntropy

    gen = torch.Generator().manual_seed(2)
    n, chunk = 1024, 64   # 16 chunks
    h = torch.randn(n, 64, generator=gen).bfloat16()
    w = (torch.randn(300, 64, generator=gen) * 0.3).bfloat16().requires_grad_()
    t = torch.randint(0, 300, (n,), generator=gen)
    grads = {}
    for mode in ("one_gemm", "per_chunk"):
        w.grad = None
        _ChunkedLinearCrossEntropy.apply(h, w, t, chunk, torch.bfloat16, None, mode).backward()
        grads[mode] = w.grad.double()
    assert w.grad.dtype == torch.bfloat16
    logits = (h @ w.detach().t()).float()
    p = torch.exp(logits - torch.logsumexp(logits, dim=-1)[:, None])
    g = torch.where(torch.arange(300)[None, :] == t[:, None], p - 1.0, p).bfloat16()
    exact = g.double().t() @ h.double() / n
    err = {m: (grads[m] - exact).abs().mean().item() for m in grads}
    assert err["one_gemm"] < 0.85 * err["per_chunk"], err
    # and each is within BF16's rounding of the exact value
    assert torch.allclose(grads["one_gemm"], exact, rtol=2 ** -7, atol=1e-6)


def test_the_weight_gradients_scaled_cast_is_one_fp32_multiply_compiled_or_not():
    # _ChunkedLinearCrossEntropy's backward scales one_gemm's BF16 weight gradient by grad_out / n in FP32 and rounds
    # once (compiled on a GPU): the same bits as the eager FP32 product, also where the scale is not a power of two.
    # (The GPU's reason: eager's BF16 x FP32-0-d-tensor product runs torch's unvectorized casting kernel there.)
    from training.model import _scale_in_fp32
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 64, generator=gen).bfloat16()
    scale = torch.tensor(1.0 / 3000.0)
    eager = (x.float() * scale).to(torch.bfloat16)
    assert torch.equal(_scale_in_fp32(x, scale, torch.bfloat16), eager)
    assert torch.equal(torch.compile(_scale_in_fp32, dynamic=False)(x, scale, torch.bfloat16), eager)


def test_the_loss_refuses_an_unknown_weight_gradient_mode():
    model = build_model(llama_config("tiny", 512, 32), 0)
    with pytest.raises(ValueError, match="one_gemm"):
        CausalLMLoss(model, weight_grad="fp32")


def test_fused_qkv_gives_the_same_logits_and_gradients_and_splits_back_to_hf_names():
    import torch

    from training.model import build_model, fuse_qkv, join_fused_qkv, llama_config, split_fused_qkv
    cfg = llama_config({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}, 97, 16)
    plain, fused = build_model(cfg, 3), build_model(cfg, 3)
    assert fuse_qkv(fused) == 2
    attn = fused.model.layers[0].self_attn
    assert not hasattr(attn, "q_proj") and attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 32, 64)
    x = torch.randint(0, 97, (2, 16))
    a, b = plain(input_ids=x).logits, fused(input_ids=x).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    a.square().mean().backward()
    b.square().mean().backward()
    g = torch.cat([getattr(plain.model.layers[1].self_attn, n).weight.grad for n in ("q_proj", "k_proj", "v_proj")])
    torch.testing.assert_close(fused.model.layers[1].self_attn.qkv_proj.weight.grad, g, rtol=1e-5, atol=1e-7)
    hf = split_fused_qkv(fused.state_dict(), cfg)
    assert set(hf) == set(plain.state_dict())
    assert all(torch.equal(hf[k], plain.state_dict()[k]) for k in hf)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    assert torch.equal(join_fused_qkv(plain.state_dict(), name), fused.state_dict()[name])


def test_a_fused_qkv_decoder_layer_compiles_into_one_graph():
    """Regional compilation compiles each decoder layer's forward: it must trace without a graph break (an
    import of transformers' lazy module inside the forward used to split every layer's graph in two)."""
    import torch

    from training.model import build_model, fuse_gate_up, fuse_qkv, llama_config
    cfg = llama_config({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2}, 97, 16)
    model = build_model(cfg, 3)
    fuse_qkv(model)
    fuse_gate_up(model)
    torch._dynamo.reset()
    layer = model.model.layers[0]
    compiled = torch.compile(layer.forward, backend="eager", fullgraph=True)  # raises on any graph break
    x = torch.randn(2, 16, 64)
    pos = model.model.rotary_emb(x, torch.arange(16).unsqueeze(0))
    out = compiled(x, position_embeddings=pos)
    ref = layer(x, position_embeddings=pos)
    out, ref = (o[0] if isinstance(o, tuple) else o for o in (out, ref))
    torch.testing.assert_close(out, ref)


def test_fused_gate_up_gives_the_same_logits_and_gradients_and_splits_back_to_hf_names():
    import torch

    from training.model import build_model, fuse_gate_up, fuse_qkv, join_fused, llama_config, split_fused
    from training.precision import apply_recipe
    cfg = llama_config({"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2}, 97, 16)
    plain, fused = build_model(cfg, 5), build_model(cfg, 5)
    fuse_qkv(fused)
    assert fuse_gate_up(fused) == 2 and fuse_gate_up(fused) == 0  # idempotent
    mlp = fused.model.layers[0].mlp
    assert not hasattr(mlp, "gate_proj") and mlp.gate_up_proj.weight.shape == (2 * 96, 64)
    x = torch.randint(0, 97, (2, 16))
    a, b = plain(input_ids=x).logits, fused(input_ids=x).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    a.square().mean().backward()
    b.square().mean().backward()
    mp = plain.model.layers[1].mlp
    g = torch.cat([mp.gate_proj.weight.grad, mp.up_proj.weight.grad])
    torch.testing.assert_close(fused.model.layers[1].mlp.gate_up_proj.weight.grad, g, rtol=1e-5, atol=1e-7)
    hf = split_fused(fused.state_dict(), cfg)
    assert set(hf) == set(plain.state_dict())
    assert all(torch.equal(hf[k], plain.state_dict()[k]) for k in hf)
    name = "model.layers.1.mlp.gate_up_proj.weight"
    assert torch.equal(join_fused(plain.state_dict(), name), fused.state_dict()[name])
    # A recipe converts the fused projection as one linear (one per-tensor scale, as TE's linear_fc1).
    report = apply_recipe(fused, "fp8_tensorwise", bf16_last_layers=1)
    converted = {layer["name"] for layer in report.layers if layer["converted"]}
    assert "layers.0.mlp.gate_up_proj" in converted and not any(n.startswith("layers.1.") for n in converted)
