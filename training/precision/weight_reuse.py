"""Quantized weights reused across the micro-batches of a step.

With gradient accumulation every micro-batch of an optimizer step multiplies by the same weights, so a recipe
whose weight quantization is a pure function of W (the emulated MXFP8, NVFP4 and FP8 quantizers: no random
draws, no state) can quantize each weight once per step instead of once per micro-batch, with the same bits.
`QuantizedWeightReuse` does that for every `QuantizedLinear` that allows it: a forward pre-hook on each decoder
block quantizes the block's weights on its first forward after an optimizer step (the first micro-batch, or a
validation pass) and keeps them on the linears (`QuantizedLinear.cached_weight`); the other micro-batches'
forwards and backwards read them. The hook runs outside the block's compiled forward and after the overlapped
optimizer's per-block wait (hooks run in the order they were registered; the optimizer's first), so each block's
weights are quantized as soon as their update is done. `post_optimizer_step` marks every block stale.

Under torch.compile only where W's quantizer is a kernel of its own (MXFP8's fused Triton quantizer on a GPU):
a forward that quantizes W with torch ops in its compiled graph does so at no host cost, and a cache would need
a compiled call per linear to match inductor's bits (QuantizedLinear.reuses_weight_when). Measured on an H100
(1.14B, batch 4 x 2048): mxfp8 at grad_accum 2 128.7 against 131.7 ms, at grad_accum 4 163.9 against 184.6 ms.

Not used with one micro-batch per step (nothing to share; the cache would only hold memory) nor under FSDP2
(the cache would keep every block's unsharded weight). Costs the quantized copies of the weights: the BF16
values of one layout (NVFP4 with 16x16 weight tiles) or two (MXFP8) per weight, kept between micro-batches.
torchao's real FP8 linears and fp8_delayed's (whose weight scale follows an amax history that each micro-batch
updates) quantize in their own forward and are left alone.
"""
from __future__ import annotations

import torch

from training.precision.emulation import QuantizedLinear


class QuantizedWeightReuse:
    """Quantize each decoder block's weights once per optimizer step (see the module docstring). A recipe hook:
    `post_optimizer_step(model)`; `remove()` detaches it and drops the cached weights."""

    def __init__(self, blocks: list[torch.nn.Module], *, compiled: bool = False):
        self.blocks: list[tuple[torch.nn.Module, list[QuantizedLinear]]] = []
        for block in blocks:
            linears = [m for m in block.modules() if isinstance(m, QuantizedLinear) and m.reuses_weight_when(compiled)]
            if linears:
                self.blocks.append((block, linears))
        self.stale = [True] * len(self.blocks)
        self.refreshes = 0  # blocks quantized so far (tests, telemetry)
        self.handles = [block.register_forward_pre_hook(self._refresher(i))
                        for i, (block, _) in enumerate(self.blocks)]

    @property
    def linears(self) -> int:
        return sum(len(ls) for _, ls in self.blocks)

    def _refresher(self, i: int):
        def hook(module, args):
            if self.stale[i]:
                for linear in self.blocks[i][1]:
                    linear.refresh_weight_cache()
                self.stale[i] = False
                self.refreshes += 1
        return hook

    def post_optimizer_step(self, model=None) -> None:
        self.stale = [True] * len(self.blocks)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for _, linears in self.blocks:
            for linear in linears:
                linear.cached_weight = None


def reuse_applies(grad_accum: int, parallel: str, enabled: bool) -> str | None:
    """Why quantized weights are not reused in this run (None: they are)."""
    if not enabled:
        return "training.perf.reuse_quantized_weights is off"
    if grad_accum <= 1:
        return "one micro-batch per step"
    if parallel == "fsdp":
        return "FSDP2: the cache would hold every block's unsharded weight"
    return None
