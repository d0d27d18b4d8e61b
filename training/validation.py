"""Validation loss: the mean next-token loss over the run's fixed validation windows."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from training.distributed import DistContext


class ValidationLoss:
    """`loss()` evaluates `net` (a `CausalLMLoss`, compiled or not) on `windows` ([n, seq_len + 1] token
    ids), split over the ranks and summed back, in micro-batches of `micro_batch` rows; `model` (the
    module inside `net`) is put in eval mode for it and back in train mode after. `settle()` is called first,
    so an optimizer update still in flight lands in the weights before they are read."""

    def __init__(self, net: torch.nn.Module, model: torch.nn.Module, windows: torch.Tensor, *, micro_batch: int,
                 device: torch.device, ctx: DistContext | None = None, autocast=None,
                 settle: Callable[[], None] = lambda: None):
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
        self.net, self.model, self.windows = net, model, windows
        self.micro_batch, self.device = micro_batch, device
        self.ctx = ctx if ctx is not None else DistContext()
        self.autocast = autocast if autocast is not None else contextlib.nullcontext()
        self.settle = settle

    def loss(self) -> float | None:
        """The mean loss over every window (each window weighs the same); None without windows."""
        if len(self.windows) == 0:
            return None
        mine = self.windows[self.ctx.rank::self.ctx.world]
        self.settle()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.model.eval()
        with torch.no_grad():
            for chunk in mine.split(self.micro_batch):
                chunk = chunk.to(self.device, non_blocking=True)
                with self.autocast:
                    loss = self.net(chunk[:, :-1], chunk[:, 1:])
                total[0] += loss.double() * len(chunk)
                total[1] += len(chunk)
        self.model.train()
        if self.ctx.enabled:
            torch.distributed.all_reduce(total)
        return (total[0] / total[1]).item()
