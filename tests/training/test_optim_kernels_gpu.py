"""The optimizer's Triton kernels on a GPU (training/optim_kernels.py), bit for bit against what they replace:
MasterAdamW's update against its eager update, and the FSDP2 shard update against torch's CUDA fused AdamW
(bench/shard_adamw_bench.py checks the latter over ~1e9 element updates). Odd sizes (masked tails, several
blocks per tensor, a one-element tensor), gradient clipping's scale on some steps. Skipped without CUDA; the
interpreter checks (optim_kernel_interp_checks.py) run the same kernels on CPU."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = [(4096, 2048), (37,), (3, 2049), (5000,), (1,)]


def _groups(params):
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def test_master_adamw_triton_update_equals_the_eager_update_on_the_gpu():
    from training.optim import MasterAdamW

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    base = [torch.randn(s, device=dev, generator=g).bfloat16() for s in SHAPES]
    runs = {}
    for update in ("eager", "triton"):
        params = [torch.nn.Parameter(t.clone()) for t in base]
        opt = MasterAdamW(_groups(params), lr=3e-2, betas=(0.9, 0.95), update=update)
        gg = torch.Generator(device=dev).manual_seed(1)
        for step in range(4):
            for q in params:
                q.grad = (torch.randn(q.shape, device=dev, generator=gg) * 10.0 ** step).bfloat16()
            opt.grad_scale = torch.tensor(1.7, device=dev) if step % 2 else None
            opt.step()
        runs[update] = (params, opt)
    (pe, oe), (pt, ot) = runs["eager"], runs["triton"]
    for a, b in zip(pe, pt):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(oe.state[a][key], ot.state[b][key]), key
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(pt[0], base[0])


def test_shard_update_equals_torch_fused_adamw_on_the_gpu():
    from training import optim_kernels as ok

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    for shapes, wd in ((SHAPES[:3], 0.1), (SHAPES[3:], 0.0)):
        ps = [torch.randn(s, device=dev, generator=g) * 0.02 for s in shapes]
        state = {name: ([p.clone() for p in ps], [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps],
                        [torch.tensor(0.0, device=dev) for _ in ps]) for name in ("torch", "triton")}
        tables = ok.AdamWTables()
        for k in range(4):
            gs = [torch.randn(s, device=dev, generator=g) * 10.0 ** (k - 3) for s in shapes]
            kept = [x.clone() for x in gs]
            scale = torch.tensor(1.0 + 0.37 * k, device=dev) if k % 2 else None
            lr = 3e-2 / (k + 1)
            p, m, v, steps = state["torch"]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(p, [x.clone() for x in gs], m, v, [], steps, amsgrad=False, lr=lr, beta1=0.9,
                                beta2=0.95, weight_decay=wd, eps=1e-8, maximize=False, grad_scale=scale,
                                found_inf=None)
            p, m, v, steps = state["triton"]
            torch._foreach_add_(steps, 1)
            ok.adamw_shard_update(p, gs, m, v, steps, lr=lr, beta1=0.9, beta2=0.95, weight_decay=wd, eps=1e-8,
                                  grad_scale=scale, tables=tables)
            assert all(torch.equal(a, b) for a, b in zip(gs, kept)), "the gradients must not be written"
            for j, name in enumerate(("param", "exp_avg", "exp_avg_sq")):
                for a, b in zip(state["torch"][j], state["triton"][j]):
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"step {k + 1}: {name}"
