"""`bf16`: the baseline. Nothing is converted; the train loop runs BF16 autocast with FP32 master weights."""
from __future__ import annotations

from training.precision.registry import Recipe, register


@register
class BF16Recipe(Recipe):
    name = "bf16"

    def real_unavailable(self, device, options):
        return None
