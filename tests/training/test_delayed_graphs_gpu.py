"""GPU only (SM89+, skipped elsewhere): fp8_delayed's real layers replayed as CUDA graphs (the recipe's
`cuda_graphs` option, on: torch.compile mode reduce-overhead, layers compiled one by one) train like the same run
without graphs: the amax history, fed by every micro-batch (dY's amax leaves each backward through a token's
gradient) and pushed by the post-step hook, must see the same amaxes, with gradient accumulation and validation
between steps."""
import pytest
import torch

from tests.training.graph_runs import assert_graphs_by_default_train_like_without

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an SM89+ GPU (FP8 GEMMs)")


def test_delayed_scaling_replays_cuda_graphs_by_default_and_trains_like_without_them():
    assert_graphs_by_default_train_like_without("fp8_delayed", {"amax_history_len": 4})
