"""GPU only (skipped elsewhere): a recipe's compiled step compiles once, in one graph, and later steps reuse it.

State a layer builds on its first call inside the compiled step is traced into that step: NVFP4's quantizers built
their kernels' RHT operand there, which split the first compiled step into 12 graphs for a 2-layer model on an H200
(other values than every later step's, graph boundaries rounding to BF16) and changed what dynamo guards on
(bench/NOTES_floor.md 86). On a CPU every recipe compiled once in one graph before that fix too (the GPU's fused paths
are where such state lives), hence a GPU test. fp8_delayed switches to its fused functions once the amax history
exists, after its first step: one recompilation there is by design."""
from __future__ import annotations

import pytest
import torch

from bench.first_compile_probe import build_with_report, step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the recipes' fused paths)")


@pytest.mark.parametrize("recipe", ["bf16", "fp8_tensorwise", "fp8_delayed", "mxfp8", "nvfp4"])
def test_three_compiled_steps_compile_once_without_graph_breaks(recipe):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, report = build_with_report(recipe, 2, "cuda")
    ids = torch.randint(0, 512, (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    compiled = torch.compile(model)
    for _ in range(3):
        values = step(model, compiled, ids)
        for hook in report.hooks:  # as the training loop after each optimizer step (fp8_delayed's history)
            hook.post_optimizer_step(model)
    assert values[1].abs().sum() > 0
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["frames"]["ok"] <= (2 if recipe == "fp8_delayed" else 1), dict(counters["frames"])
