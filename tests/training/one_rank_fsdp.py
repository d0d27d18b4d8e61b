"""What the one-rank FSDP2 tests share: a free local port for a gloo group of one process, a dict the spawned
processes report into, and the small model they shard (three Linear-LayerNorm-Linear blocks, each its own FSDP2
unit, BF16 compute with FP32 reduction as training runs)."""
from __future__ import annotations

import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def results_dict():
    """A dict the processes of `mp.spawn` write their results into. Its manager is started in a fresh interpreter
    (spawn), not forked from the pytest worker: in one CI run a forked manager died at start ("terminate called
    after throwing an instance of 'std::system_error'", an EOFError in the test), presumably from the state of the
    threads it inherited; a spawned one inherits none. The manager lives as long as the returned dict."""
    import torch.multiprocessing as mp

    return mp.get_context("spawn").Manager().dict()


def sharded_blocks() -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """(blocks, root): seeded, every block sharded (resharded after its forward), then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 24))
              for _ in range(3)]
    model = torch.nn.Sequential(*blocks)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in blocks:
        fully_shard(b, mp_policy=mp_policy, reshard_after_forward=True)
    fully_shard(model, mp_policy=mp_policy)
    return blocks, model
