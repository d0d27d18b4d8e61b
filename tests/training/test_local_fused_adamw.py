"""training.parallel.LocalFusedAdamW (torch's fused AdamW step called on FSDP2's local shards) against
`optimizer.step()` over the DTensors, on 2 gloo processes: the same bits after several steps, with two
parameter groups (one without weight decay), a learning rate changing every step, and a subset update as the
overlapped step makes (one FSDP unit at a time). With a clipping factor folded in (`grad_scale`, as
`clip_sharded(..., fold_into=...)` sets it), against dividing the gradients first and then `optimizer.step()`:
the first step takes the fallback (no state yet), the later ones the fused call."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.training.one_rank_fsdp import free_port, results_dict


def _build(seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    blocks = [torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 24))
              for _ in range(3)]
    model = torch.nn.Sequential(*blocks)
    for b in blocks:
        fully_shard(b)
    fully_shard(model)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return model, blocks, opt


def _worker(rank: int, world: int, port: int, out: dict, scaled: bool = False, kernel: str = "torch") -> None:
    import torch.distributed as dist

    from training.parallel import LocalFusedAdamW, local

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = []
    for use_local in (False, True):
        model, blocks, opt = _build(0)
        update = LocalFusedAdamW(opt, kernel=kernel)
        assert update.usable
        g = torch.Generator().manual_seed(100 + rank)
        for step in range(5):
            x = torch.randn(8, 24, generator=g)
            model(x).square().mean().backward()
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (step + 1)
            device = local(next(model.parameters())).device  # FSDP2 moves the model to the GPU where there is one
            scale = torch.tensor(1.0 + 0.37 * step, device=device) if scaled else None
            if use_local:
                update.grad_scale = scale
            elif scaled:
                torch._foreach_div_([local(p.grad) for p in model.parameters()], scale)
            if use_local:  # unit by unit, as OverlappedShardedStep: each block, then the rest (none here)
                for b in blocks:
                    update.step({id(p) for p in b.parameters()})
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        params = [local(p).detach().clone() for p in model.parameters()]
        moments = [local(opt.state[p][k]).clone() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
        steps = [float(opt.state[p]["step"]) for p in model.parameters()]
        results.append((params, moments, steps))
    (p0, m0, s0), (p1, m1, s1) = results
    out[rank] = {"params_equal": all(torch.equal(a, b) for a, b in zip(p0, p1)),
                 "moments_equal": all(torch.equal(a, b) for a, b in zip(m0, m1)),
                 "steps": (s0, s1), "moved": any(not torch.equal(a, b) for a, b in zip(p0, _initial(rank)))}
    dist.destroy_process_group()


def _initial(rank: int):
    from training.parallel import local
    model, _, _ = _build(0)
    return [local(p).detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kernel", ["torch", pytest.param("auto", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="auto is the Triton shard update on CUDA, torch's (the other case) on CPU"))])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "clipping_folded"])
def test_local_fused_adamw_gives_the_bits_of_the_optimizer_step_on_two_processes(scaled, kernel):
    """`kernel="auto"` is the Triton shard update where FSDP2 put the model on a GPU (the GPU host), torch's fused
    AdamW on CPU."""
    out = results_dict()
    mp.spawn(_worker, args=(2, free_port(), out, scaled, kernel), nprocs=2, join=True)
    for rank in (0, 1):
        r = out[rank]
        assert r["moved"], "the parameters must have changed (the test would pass vacuously otherwise)"
        assert r["params_equal"] and r["moments_equal"], r
        assert r["steps"][0] == r["steps"][1] == [5.0] * len(r["steps"][0])
