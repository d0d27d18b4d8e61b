"""MasterAdamW's Triton update (training/optim_kernels.py) against the eager update, on CPU under Triton's
interpreter. The interpreter must be on before triton is first imported, so test_optim_kernel_interpreted.py
runs this file in a subprocess with TRITON_INTERPRET=1; collected directly without it, it skips. The GPU run
of the same comparison (and the timing) is bench/kernel_bench.py.

The eager update's square root: torch's CPU sqrt is not correctly rounded (on an AVX2 build ~16 % of FP32
results differ in the last bit from the IEEE square root), while CUDA's, numpy's and the kernel's are. The
bit-exact comparisons therefore run the eager update with an IEEE square root (`ieee_sqrt`), which is the
eager update as CUDA computes it; against torch's CPU sqrt the results agree to FP32 rounding."""
from __future__ import annotations

import pytest
import torch

from tests.interpreted import require_interpreter

pytest.importorskip("triton")

require_interpreter("test_optim_kernel_interpreted.py")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from training import optim_kernels  # noqa: E402
from training.optim import MasterAdamW  # noqa: E402
from training.triton_math import bf16_bits_rne  # noqa: E402

# Sizes around and past BLOCK (512) and the earlier 2048: masked tails, several programs per parameter, a tiny gain.
SHAPES = [(48, 32), (37,), (3, 2049), (5000,), (2048,)]
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq", "step")


@pytest.fixture
def ieee_sqrt(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda t: torch.sqrt(t.double()).to(t.dtype))


def _groups(params):
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _twins(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]
    return [torch.nn.Parameter(t.clone()) for t in base], [torch.nn.Parameter(t.clone()) for t in base]


def _run(betas, steps, *, bucketed=False, reuse_grads=False, seed=1, programs=None):
    """Eager and Triton MasterAdamW on the same parameters and gradients; grad_scale every other step
    (global-norm clipping), gradients growing 10x per step (moments in several binades)."""
    a, b = _twins()
    eager = MasterAdamW(_groups(a), lr=3e-2, betas=betas, update="eager")
    fast = MasterAdamW(_groups(b), lr=3e-2, betas=betas, update="triton")
    fast.update_programs = programs
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for x, y in zip(a, b):
            grad = (torch.randn(x.shape, generator=g) * 10.0 ** step).to(torch.bfloat16)
            x.grad = grad
            if reuse_grads and y.grad is not None:
                y.grad.copy_(grad)  # same addresses: the kernel's address table is reused
            else:
                y.grad = grad.clone()
        scale = torch.tensor(1.7) if step % 2 else None
        eager.grad_scale, fast.grad_scale = scale, scale
        eager.step()
        if bucketed:  # as OverlappedOptimizerStep: bucket by bucket
            for bucket in (b[:2], b[2:]):
                fast.step_params(bucket)
        else:
            fast.step()
    return a, b, eager, fast


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.4, 0.999)])  # both forms of torch's lerp (weight < / >= 0.5)
def test_triton_update_is_bit_exact_with_the_eager_update(ieee_sqrt, betas):
    a, b, eager, fast = _run(betas, steps=4)
    for x, y in zip(a, b):
        for key in STATE_KEYS:
            assert torch.equal(eager.state[x][key], fast.state[y][key]), (tuple(x.shape), key)
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), tuple(x.shape)


@pytest.mark.parametrize("programs", [None, 2])  # 2: each program loops over several tensors' blocks
@pytest.mark.parametrize("block", [None, 2048])  # None: the module's tile; 2048: the H100's earlier one
def test_bucketed_steps_and_reused_addresses_give_the_same_update(ieee_sqrt, monkeypatch, programs, block):
    if block is not None:
        monkeypatch.setattr(optim_kernels, "BLOCK", block)
    a, b, eager, fast = _run((0.9, 0.95), steps=3, bucketed=True, reuse_grads=True, programs=programs)
    for x, y in zip(a, b):
        assert torch.equal(eager.state[x]["master"], fast.state[y]["master"])
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_against_torch_cpu_sqrt_the_update_agrees_to_fp32_rounding():
    a, b, eager, fast = _run((0.9, 0.95), steps=4)
    for x, y in zip(a, b):
        torch.testing.assert_close(fast.state[y]["master"], eager.state[x]["master"], rtol=2e-6, atol=1e-7)


@triton.jit
def _round_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, bf16_bits_rne(tl.load(x_ptr + offs)))


def test_bf16_rounding_of_the_parameter_is_torchs():
    """Ties to even, carries into the exponent, overflow to inf, subnormals and signed zeros as
    `Tensor.to(torch.bfloat16)` on CPU (the kernel rounds on the bits); a NaN stays a NaN (its bits differ
    between torch's CPU and CUDA conversions anyway)."""
    special = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20, 2.0 - 2 ** -9,
                            3.3895314e38, float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -3e-39],
                           dtype=torch.float32)
    x = torch.cat([special, torch.randn(116) * 10.0 ** torch.randint(-30, 30, (116,)),
                   torch.tensor([float("nan")])])
    out = torch.empty(128, dtype=torch.int16)
    _round_kernel[(1,)](x, out, N=128)
    assert torch.equal(out[:-1], x[:-1].to(torch.bfloat16).view(torch.int16))
    assert torch.isnan(out[-1:].view(torch.bfloat16)).all()


# ---------------------------------------------------------------------------------------------------
# adamw_shard_update: torch's CUDA fused AdamW over FP32 shards (training/optim_kernels.py gives its arithmetic)
def _fmaf(a, b, c):
    """FP32 fma: the product of two FP32 values is exact in FP64, then one FP64 add (rounding there changes the
    FP32 result only in ~2^-29 of the cases, not in these tests), then FP32."""
    return (a.double() * b.double() + c.double()).float()


def _shard_reference(p, g, m, v, step_size, bc2s, *, lr, wd, beta1, beta2, eps, scale):
    def f(x):
        return torch.tensor(x, dtype=torch.float32)
    if scale is not None:
        g = (g.double() / scale.double()).float()  # the correctly rounded FP32 quotient
    if wd:
        p = _fmaf(-(f(lr) * f(wd)), p, p)
    b1, b2 = f(beta1), f(beta2)
    m = _fmaf(b1, m, (1 - b1) * g)
    v = _fmaf(b2, v, (1 - b2) * (g * g))
    root = v.double().sqrt().float()  # IEEE (torch's CPU float sqrt is not correctly rounded)
    denom = (root.double() / bc2s.double()).float() + f(eps)
    return p - ((step_size * m).double() / denom.double()).float(), m, v


@pytest.mark.parametrize("wd,bf16_grads,outs,tile", [(0.0, False, False, None), (0.1, False, False, None),
                                                     (0.1, True, True, None), (0.0, True, False, None),
                                                     (0.1, True, True, (2048, 8))])
def test_shard_update_matches_torch_cuda_arithmetic(wd, bf16_grads, outs, tile):
    """Also with BF16 gradients (FSDP2's one-rank direct step: read as their exact FP32 values, so the update of
    their FP32 copies) and BF16 copies of the updated parameters written by the same pass (round to nearest even,
    as `.to(torch.bfloat16)`). `tile`: (block, num_warps), None for the module's; (2048, 8) the H100's earlier one, as
    the probe passes it."""
    from training import optim_kernels as ok

    g_ = torch.Generator().manual_seed(3)
    shapes = [(48, 32), (37,), (3, 2049), (5000,)]
    ps = [torch.randn(s, generator=g_) * 0.02 for s in shapes]
    ms = [torch.zeros(s) for s in shapes]
    vs = [torch.zeros(s) for s in shapes]
    steps = [torch.tensor(0.0) for _ in shapes]
    ref = [[t.clone() for t in ps], [t.clone() for t in ms], [t.clone() for t in vs]]
    tables = ok.AdamWTables()
    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8)
    for k in range(4):
        lr = 3e-2 / (k + 1)
        gs = [torch.randn(s, generator=g_) * 10.0 ** (k - 3) for s in shapes]
        if bf16_grads:
            gs = [g.to(torch.bfloat16) for g in gs]
        copies = [torch.full(s, 7.0, dtype=torch.bfloat16) for s in shapes] if outs else None
        kept = [g.clone() for g in gs]
        scale = torch.tensor(1.0 + 0.37 * k) if k % 2 else None
        torch._foreach_add_(steps, 1.0)
        step_size, bc2s = ok.shard_scalars(steps, lr, 0.9, 0.95)
        for j in range(len(shapes)):
            ref[0][j], ref[1][j], ref[2][j] = _shard_reference(
                ref[0][j], gs[j].float(), ref[1][j], ref[2][j], step_size[j], bc2s[j], lr=lr, wd=wd, scale=scale,
                **hyper)
        assert ok.shard_supported(ps, gs, copies)
        ok.adamw_shard_update(ps, gs, ms, vs, steps, lr=lr, weight_decay=wd, grad_scale=scale, tables=tables,
                              outs=copies, **hyper, **(dict(zip(("block", "num_warps"), tile)) if tile else {}))
        if outs:
            for c, p in zip(copies, ref[0]):
                assert torch.equal(c.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))
        assert all(torch.equal(a, b) for a, b in zip(gs, kept)), "the gradients must not be written"
        for name, ours, theirs in (("param", ps, ref[0]), ("exp_avg", ms, ref[1]), ("exp_avg_sq", vs, ref[2])):
            bad = sum(int((a.view(torch.int32) != b.view(torch.int32)).sum()) for a, b in zip(ours, theirs))
            assert bad == 0, f"step {k + 1}: {bad} elements of {name} differ"
    assert not torch.equal(ps[0], torch.zeros_like(ps[0]))
