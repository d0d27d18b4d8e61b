"""GPU only (skipped on CPU): the fused Triton paths of the emulated MXFP8 and NVFP4 linears read the per-step
weight cache (training.precision.weight_reuse) with the same bits as quantizing W in every micro-batch."""
import pytest
import torch

from tests.training.test_weight_reuse import _compiled_block_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_the_fused_path_reads_the_cached_weight_with_the_same_bits(recipe):
    reused, graphs, (refreshes, path) = _compiled_block_steps(recipe, True, device="cuda", dtype=torch.bfloat16)
    fresh, graphs_fresh, _ = _compiled_block_steps(recipe, False, device="cuda", dtype=torch.bfloat16)
    assert refreshes == 3 and path == "fused"  # the Triton quantizers' path
    mismatched = [i for i, (a, b) in enumerate(zip(reused, fresh)) if not torch.equal(a, b)]
    assert not mismatched, mismatched
    assert graphs[0] == graphs[1] and graphs_fresh[0] == graphs_fresh[1], (graphs, graphs_fresh)  # no recompiles
