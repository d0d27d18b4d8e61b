"""GPU only (skipped elsewhere): training.perf.rope_backward one_pass (training.rope_triton's Triton pass) changes how
the compiled step forms the fused QKV projection's dY, not what it is.

- The attention forward up to SDPA's inputs of a BF16 Llama block with a fused QKV projection, compiled (inductor's
  default mode, and CUDA graphs), one_pass against compiled, both fed the same dQ, dK and dV laid out as cuDNN's
  attention backward writes them: q, k, v, dX and dW bit for bit over three steps.
- Two BF16 Llama blocks compiled whole with SDPA's attention: the same logits, and every gradient within BF16
  rounding (cuDNN's attention backward is not bitwise reproducible from call to call, so the paths' dQ, dK and dV
  themselves may differ in the last bits)."""
import copy

import pytest
import torch

from tests.qkv_front import cudnn_laid_out_grads, front_step
from training.model import build_model, fuse_qkv, llama_config, set_rope_backward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton)")


def _pair(attn_implementation="sdpa", layers=1):
    config = llama_config({"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": layers,
                           "num_attention_heads": 4, "num_key_value_heads": 2}, 97, 128)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    base = build_model(config, 3).to("cuda", torch.bfloat16)
    fuse_qkv(base)
    one = copy.deepcopy(base)
    assert set_rope_backward(base, "compiled", on_cuda=True) == "compiled"
    assert set_rope_backward(one, "one_pass", on_cuda=True) == "one_pass"
    return base, one


def _front(attn, x, cos, sin):
    """The fused-QKV attention forward up to SDPA's inputs (training.model._fused_qkv_attention_forward)."""
    from training.rope_triton import split_qkv_rope

    return split_qkv_rope(attn.qkv_proj(x), cos, sin, attn.qkv_split, attn.head_dim, attn.rope_one_pass)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["compiled", "cuda_graphs"])
def test_cudnn_laid_out_gradients_give_the_same_dy_compiled(mode):
    torch._dynamo.reset()
    base, one = _pair()
    rope = base.model.rotary_emb
    batch, tokens, d = 2, 128, 64
    attns = [m.model.layers[0].self_attn for m in (base, one)]
    run = [torch.compile(lambda x, c, s, a=a: _front(a, x, c, s), mode=mode) for a in attns]
    for step in range(3):
        x = torch.randn(batch, tokens, 256, device="cuda", dtype=torch.bfloat16)
        cos, sin = rope(x, torch.arange(tokens, device="cuda").unsqueeze(0))
        grads = cudnn_laid_out_grads(batch, tokens, d, (4, 2, 2), 10 ** (step - 1))
        results = [front_step(fn, attn, x, cos, sin, grads, mode == "reduce-overhead") for fn, attn in zip(run, attns)]
        for name, want, got in zip(("q", "k", "v", "dx", "dw"), *results):
            assert got.abs().sum() > 0 and torch.equal(got, want), f"step {step}: {name}"


def test_two_blocks_compiled_whole_give_the_same_logits_and_gradients_within_rounding():
    """Compiled under inductor's deterministic mode: by default inductor times padded against unpadded matmuls for
    shapes like the 97-token vocabulary's (pad_mm) and keeps the faster, so two compilations of the same forward could
    take different GEMMs and differ in the logits' last bits. In one pytest process after the other GPU tests the
    default mode's logits differed so (H200, 2026-11-28 at 59d1e21 and 2026-11-29 at fbcf281), alone they did not."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    base, one = _pair(layers=2)
    ids = torch.randint(0, 97, (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    for model in (base, one):
        with inductor_config.patch({"deterministic": True}):
            logits = torch.compile(model)(input_ids=ids).logits
            logits.float().square().mean().backward()
        results.append([logits.detach()] + [p.grad.clone() for p in model.parameters()])
    assert torch.equal(results[0][0], results[1][0])
    for i, (a, b) in enumerate(zip(*results)):
        err = ((b.float() - a.float()).norm() / a.float().norm()).item()
        assert a.float().abs().sum() > 0 and err < 0.02, f"tensor {i}: rel. error {err:.3g}"


def _kernels(fn, *args) -> list[str]:
    fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_compiled_the_passes_launch_their_kernel_and_leave_the_rope_tables_alone():
    """Inductor copies a graph input into a scratch buffer and back around a user kernel it thinks writes it. The
    kernels take their store addresses from their own indices (rope_bwd_tile returns values only), so the analysis
    finds that only their outputs are written: no copies of cos and sin in and out of each layer's backward."""
    from training.precision.fp8_rope_triton import rope_bwd_fp8
    from training.rope_triton import rope_bwd

    torch._dynamo.reset()
    b, t, d = 2, 128, 64
    dq, dk, dv = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    cos, sin = (torch.randn(1, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = torch.tensor(100.0, device="cuda")
    bf16 = _kernels(torch.compile(rope_bwd), dq, dk, dv, cos, sin)
    assert bf16 == ["_rope_bwd_kernel"], bf16
    fp8 = _kernels(torch.compile(rope_bwd_fp8), dq, dk, dv, cos, sin, scale)
    # the kernel and inductor's reduction of its amax partials; with the tables copied in and out, four more
    assert "_rope_bwd_fp8_kernel" in fp8 and len(fp8) == 2, fp8
