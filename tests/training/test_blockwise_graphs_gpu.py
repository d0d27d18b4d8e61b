"""GPU only (SM90+, skipped elsewhere): fp8_blockwise's real kernels replay as CUDA graphs by default (the recipe's
`cuda_graphs` option) and train like the same run without graphs, with gradient accumulation and validation
between steps (validation runs the same compiled layers without grad: other graphs, same pool)."""
import pytest
import torch

from tests.training.graph_runs import assert_graphs_by_default_train_like_without

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs an SM90+ GPU (torchao's blockwise FP8 kernels)")


@pytest.fixture(autouse=True, scope="module")
def _autotune_policy():
    from training.precision.fp8_blockwise import apply_autotune_policy
    apply_autotune_policy()


def test_blockwise_replays_cuda_graphs_by_default_and_trains_like_without_them():
    assert_graphs_by_default_train_like_without("fp8_blockwise")
