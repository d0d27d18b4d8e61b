"""GPU only (skipped on CPU): the emulated MXFP8 and NVFP4 linears read the per-step weight cache
(training.precision.weight_reuse) with the same bits as quantizing W in every micro-batch: MXFP8's fused Triton
quantizer in a compiled block, NVFP4's torch weight quantizer in an eager one (a compiled one keeps quantizing in
its graph)."""
import pytest
import torch

from tests.training.test_weight_reuse import _block_steps, same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _against_fresh(recipe: str, compiled: bool):
    """(linears cached, refreshes, path), whether every output and gradient has the bits of the uncached block,
    and the graph counts (after step 1, at the end) with and without the cache."""
    kw = dict(compiled=compiled, device="cuda", dtype=torch.bfloat16)
    reused, graphs, info = _block_steps(recipe, True, **kw)
    fresh, graphs_fresh, _ = _block_steps(recipe, False, **kw)
    return info, same(reused, fresh), graphs, graphs_fresh


def test_a_compiled_mxfp8_block_reads_the_fused_kernels_cache_with_the_same_bits_and_no_recompiles():
    info, bits, graphs, graphs_fresh = _against_fresh("mxfp8", compiled=True)
    assert info == (1, 3, "fused") and bits
    assert graphs[0] == graphs[1] and graphs_fresh[0] == graphs_fresh[1], (graphs, graphs_fresh)  # no recompiles


def test_nvfp4_reuses_in_an_eager_block_and_not_in_a_compiled_one():
    info, bits, _, _ = _against_fresh("nvfp4", compiled=False)
    assert info == (1, 3, "fused") and bits
    _, _, (linears, _, _) = _block_steps("nvfp4", True, compiled=True, device="cuda", dtype=torch.bfloat16)
    assert linears == 0
