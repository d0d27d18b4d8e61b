"""`bf16`: the baseline. Nothing is converted; the train loop runs BF16 autocast with FP32 master weights."""
from __future__ import annotations

from training.precision.registry import Recipe, register


@register
class BF16Recipe(Recipe):
    name = "bf16"
    summary = "BF16 compute (autocast), FP32 master weights; the baseline every other recipe is compared with"
    gpu_requirement = "any GPU (BF16 autocast); on CPU the train loop computes in FP32"
    options = {}

    def real_unavailable(self, device, options):
        return None
