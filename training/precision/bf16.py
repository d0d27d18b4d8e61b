"""`bf16`: the baseline. Nothing is converted. On a GPU the train loop computes in BF16 (BF16 parameters with FP32
masters by default, or BF16 autocast over FP32 parameters: training.param_dtype); on a CPU it computes in FP32 (the
CPU default, training/setup.py), as do the emulated GEMMs of the other recipes there, so a CPU comparison is FP32
against each format's quantization."""
from __future__ import annotations

from training.precision.registry import Recipe, register


@register
class BF16Recipe(Recipe):
    name = "bf16"

    def real_unavailable(self, device, options):
        return None
