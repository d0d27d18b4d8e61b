"""MasterAdamW: AdamW on FP32 master weights of BF16 parameters (the GPU default of train.py)."""
import pytest
import torch

from training.optim import MasterAdamW

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = [(48, 32), (32,), (16, 48)]


def _pair(seed=0):
    """FP32 parameters for torch.optim.AdamW and BF16 parameters holding the same (BF16-exact) values."""
    g = torch.Generator().manual_seed(seed)
    bf = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in SHAPES]
    ref = [torch.nn.Parameter(p.detach().float()) for p in bf]
    return ref, bf


def _grads(params_ref, params_bf, g):
    for r, b in zip(params_ref, params_bf):
        grad = torch.randn(r.shape, generator=g).to(torch.bfloat16)
        r.grad, b.grad = grad.float(), grad.clone()


def _step_both(ref, bf, opt_ref, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _grads(ref, bf, g)
        opt_ref.step()
        opt.step()


def test_masters_follow_torch_adamw_and_parameters_are_the_rounded_masters():
    ref, bf = _pair()
    opt_ref = torch.optim.AdamW(ref, **HYPER)
    opt = MasterAdamW(bf, **HYPER)
    _step_both(ref, bf, opt_ref, opt, steps=6, seed=1)
    for r, b in zip(ref, bf):
        m = opt.master(b)
        assert m.dtype == torch.float32
        torch.testing.assert_close(m, r.detach(), rtol=0, atol=5e-7)
        assert torch.equal(b.detach(), m.to(torch.bfloat16))
        # The master keeps detail a BF16 parameter cannot hold.
        assert not torch.equal(m, m.to(torch.bfloat16).float())


def test_grad_scale_divides_every_gradient_like_fused_adamw():
    ref, bf = _pair()
    opt_ref = torch.optim.AdamW(ref, **HYPER, fused=True)
    opt = MasterAdamW(bf, **HYPER)
    opt_ref.grad_scale = torch.tensor(4.0)
    opt.grad_scale = torch.tensor(4.0)
    _step_both(ref, bf, opt_ref, opt, steps=3, seed=2)
    for r, b in zip(ref, bf):
        torch.testing.assert_close(opt.master(b), r.detach(), rtol=0, atol=5e-7)


def test_state_dict_round_trip_keeps_fp32_masters_bit_for_bit():
    _, bf = _pair()
    opt = MasterAdamW(bf, **HYPER)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p in bf:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        opt.step()
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in bf]
    fresh = MasterAdamW(fresh_params, **HYPER)
    fresh.load_state_dict(opt.state_dict())
    for a, b in zip(fresh_params, bf):
        for key in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert fresh.state[a][key].dtype == torch.float32
            assert torch.equal(fresh.state[a][key], opt.state[b][key]), key
    # ...and both continue identically.
    for a, b in zip(fresh_params, bf):
        a.grad = torch.randn(a.shape, generator=g).to(torch.bfloat16)
        b.grad = a.grad.clone()
    fresh.step()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(fresh_params, bf))


def test_loading_an_fp32_adamw_state_says_why_it_cannot_resume():
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    other = torch.optim.AdamW(params, **HYPER)
    params[0].grad = torch.randn(4, 4)
    other.step()
    opt = MasterAdamW([torch.nn.Parameter(torch.randn(4, 4).to(torch.bfloat16))], **HYPER)
    with pytest.raises(ValueError, match="not written by MasterAdamW"):
        opt.load_state_dict(other.state_dict())


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(betas=(0.9, 1.0)), dict(eps=0.0), dict(weight_decay=-0.1),
                                 dict(update="fused")])
def test_bad_hyperparameters_are_rejected(bad):
    with pytest.raises(ValueError):
        MasterAdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))], **{**HYPER, **bad})


def test_compiled_update_matches_the_eager_one():
    """The update torch.compile turns into one fused kernel per parameter on GPU, checked on CPU."""
    _, bf = _pair()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in bf]
    eager = MasterAdamW(bf, **HYPER, update="eager")
    compiled = MasterAdamW(twin, **HYPER, update="compiled")
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        for a, b in zip(bf, twin):
            a.grad = torch.randn(a.shape, generator=g).to(torch.bfloat16)
            b.grad = a.grad.clone()
        eager.step()
        compiled.step()
    for a, b in zip(bf, twin):
        torch.testing.assert_close(compiled.master(b), eager.master(a), rtol=0, atol=1e-6)


def test_compiled_bucket_updates_match_the_eager_step_with_few_graphs():
    """The overlapped step updates bucket by bucket (step_params(subset)); each call is one compiled graph for
    a list of parameters, reused for every list of the same length (not one compiled call per parameter)."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(7)
    layers = [[(64, 32), (32, 64), (32,)] for _ in range(4)]  # 4 "layers" of 3 parameters
    base = [[torch.randn(s, generator=g).to(torch.bfloat16) for s in layer] for layer in layers]
    eager_p = [[torch.nn.Parameter(t.clone()) for t in layer] for layer in base]
    comp_p = [[torch.nn.Parameter(t.clone()) for t in layer] for layer in base]

    def groups(ps):  # decay matrices, not gains: two groups, as train.py
        flat = [p for layer in ps for p in layer]
        return [{"params": [p for p in flat if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in flat if p.dim() < 2], "weight_decay": 0.0}]
    eager = MasterAdamW(groups(eager_p), lr=1e-2, betas=(0.9, 0.95), update="eager")
    comp = MasterAdamW(groups(comp_p), lr=1e-2, betas=(0.9, 0.95), update="compiled")
    torch._dynamo.reset()
    counters.clear()
    for _ in range(3):
        for le, lc in zip(eager_p, comp_p):
            for a, b in zip(le, lc):
                a.grad = torch.randn(a.shape, generator=g).to(torch.bfloat16)
                b.grad = a.grad.clone()
        eager.step()
        for layer in comp_p:  # bucket by bucket, as OverlappedOptimizerStep does
            comp.step_params(layer)
    for le, lc in zip(eager_p, comp_p):
        for a, b in zip(le, lc):
            torch.testing.assert_close(comp.master(b), eager.master(a), rtol=0, atol=1e-6)
            assert torch.equal(comp.state[b]["step"], eager.state[a]["step"])
    # per bucket: a list of 2 matrices (decay group) and of 1 gain (no-decay group): two graphs in all
    assert counters["stats"]["unique_graphs"] <= 2


def test_triton_update_of_parameters_it_cannot_take_says_what_to_use():
    p = torch.nn.Parameter(torch.zeros(4))  # FP32 parameter: the kernel takes BF16 ones
    opt = MasterAdamW([p], **HYPER, update="triton")
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match="update='auto'"):
        opt.step()
