"""training.parallel.OneRankReduceScatter: FSDP2 on a one-rank group without the copy of every gradient from
the reduce-scatter input buffer into its output buffer. The gradients must be the bits FSDP2's own path gives
(two backwards accumulated, BF16 compute with FP32 reduction, as the training runs), and each unit's sharded
gradients must be views of one buffer (the copy really gone)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from tests.training.one_rank_fsdp import free_port, results_dict, sharded_blocks


def _grads(custom: bool):
    from training.parallel import OneRankReduceScatter, local

    blocks, model = sharded_blocks()
    if custom:
        for unit in blocks:
            unit.set_custom_reduce_scatter(OneRankReduceScatter())
    g = torch.Generator().manual_seed(7)
    block_numel = sum(p.numel() for p in blocks[0].parameters())
    with _GradientCopies(block_numel) as copies:
        for _ in range(2):
            model(torch.randn(8, 24, generator=g)).float().square().mean().backward()
    grads = [local(p.grad).clone() for p in model.parameters()]
    storages = [{local(p.grad).untyped_storage().data_ptr() for p in b.parameters()} for b in blocks]
    return grads, storages, copies.count


class _GradientCopies(TorchDispatchMode):
    """Counts copies of a whole unit's FP32 gradient buffer into another buffer (FSDP2's one-rank
    `reduce_output.copy_(reduce_scatter_input)`)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if (dst.numel() == src.numel() == self.numel and dst.dtype == torch.float32
                    and dst.data_ptr() != src.data_ptr()):
                self.count += 1
        return func(*args, **(kwargs or {}))


def _worker(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    plain, plain_storages, out["plain_copies"] = _grads(False)
    aliased, aliased_storages, out["aliased_copies"] = _grads(True)
    out["equal"] = all(torch.equal(a, b) for a, b in zip(plain, aliased))
    out["nonzero"] = all(bool(g.abs().sum() > 0) for g in plain)
    out["plain_storages"] = [len(s) for s in plain_storages]
    out["aliased_storages"] = [len(s) for s in aliased_storages]
    dist.destroy_process_group()


def test_one_rank_reduce_scatter_gives_fsdp2s_gradients_without_the_copy():
    out = results_dict()
    mp.spawn(_worker, args=(free_port(), out), nprocs=1, join=True)
    assert out["nonzero"], "every gradient must be non-zero (the comparison would pass vacuously otherwise)"
    assert out["equal"]
    # Each block's gradients share one buffer either way; what differs is the copy into it: FSDP2's own path
    # copies each block's buffer once per backward (3 blocks x 2 backwards), the aliased one never.
    assert out["aliased_storages"] == out["plain_storages"] == [1, 1, 1]
    assert out["plain_copies"] == 6
    assert out["aliased_copies"] == 0


def test_the_output_must_be_the_input_just_packed():
    from training.parallel import OneRankReduceScatter

    comm = OneRankReduceScatter()
    buf = comm.allocate((10,), dtype=torch.float32, device=torch.device("cpu"))
    assert comm.allocate((10,), dtype=torch.float32, device=torch.device("cpu")) is buf
    fresh = comm.allocate((10,), dtype=torch.float32, device=torch.device("cpu"))
    assert fresh is not buf  # the next unit's input is a new buffer
    with pytest.raises(RuntimeError, match="unlike its input"):
        comm.allocate((12,), dtype=torch.float32, device=torch.device("cpu"))
