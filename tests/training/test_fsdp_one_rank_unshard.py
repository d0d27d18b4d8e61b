"""training.parallel.one_rank_cast_into_output: FSDP2's one-rank unshard as one pass, the FP32 shard cast straight
into the BF16 unsharded parameter, instead of a cast into a new tensor and a copy of that. Training must give the
bits of FSDP2's own path (BF16 compute, FP32 reduction, blocks resharded after the forward and gathered again for
the backward, the shards changed by an optimizer step between steps), and the copies must really be gone."""
from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from tests.training.one_rank_fsdp import free_port, results_dict, sharded_blocks


class _Copies(TorchDispatchMode):
    """FP32 -> BF16 casts into new tensors (FSDP2's `all_gather_inputs`), and copy_ calls into BF16 tensors: from
    another BF16 tensor (FSDP2's one-rank copy into the unsharded parameter) or from an FP32 one (a cast in place)."""

    def __init__(self):
        super().__init__()
        self.new_casts = self.bf16_copies = self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func is torch.ops.aten._to_copy.default and (kwargs or {}).get("dtype") == torch.bfloat16
                and args[0].dtype == torch.float32):
            self.new_casts += 1
        if func is torch.ops.aten.copy_.default and args[0].dtype == torch.bfloat16:
            dst, src = args[0], args[1]
            if src.dtype == torch.bfloat16 and dst.data_ptr() != src.data_ptr():
                self.bf16_copies += 1
            elif src.dtype == torch.float32:
                self.casts += 1
        return func(*args, **(kwargs or {}))


def _train(fused: bool):
    from training.parallel import local, one_rank_cast_into_output

    blocks, model = sharded_blocks()
    marked = sum(one_rank_cast_into_output(unit) for unit in [*blocks, model]) if fused else 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    losses = []
    with _Copies() as copies:
        for _ in range(4):
            loss = model(torch.randn(8, 24, generator=g)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, [local(p).clone() for p in model.parameters()], copies, marked


def _worker(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    plain_losses, plain_params, plain, _ = _train(False)
    fused_losses, fused_params, fused, out["marked"] = _train(True)
    out["losses"] = (plain_losses, fused_losses)
    out["params_equal"] = all(torch.equal(a, b) for a, b in zip(plain_params, fused_params))
    out["params_moved"] = len(set(plain_losses)) == len(plain_losses)
    out["plain"] = (plain.new_casts, plain.bf16_copies, plain.casts)
    out["fused"] = (fused.new_casts, fused.bf16_copies, fused.casts)
    out["n_params"] = len(plain_params)
    dist.destroy_process_group()


def test_one_rank_unshard_casts_into_the_unsharded_parameter_with_fsdp2s_bits():
    out = results_dict()
    mp.spawn(_worker, args=(free_port(), out), nprocs=1, join=True)
    plain_losses, fused_losses = out["losses"]
    assert out["params_moved"], "the losses must change from step to step (the shards are updated)"
    assert fused_losses == plain_losses
    assert out["params_equal"]
    assert out["marked"] == out["n_params"] == 18
    # FSDP2's own path: every unshard of a parameter casts it into a new tensor and copies that. 4 steps of 3 blocks
    # x 6 parameters, gathered for the forward and again for the backward: 144 of each (the new-tensor casts also
    # count the inputs' casts to BF16).
    plain_new, plain_copies, plain_in_place = out["plain"]
    fused_new, fused_copies, fused_in_place = out["fused"]
    assert (plain_copies, plain_in_place) == (144, 0) and plain_new >= 144
    # Fused: a parameter's first unshard takes FSDP2's path (it makes the output there); every later one is a
    # single cast into the output, with FSDP2's copy onto itself doing nothing.
    assert (fused_copies, fused_in_place) == (18, 126)
    assert plain_new - fused_new == 126
