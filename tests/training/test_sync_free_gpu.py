"""GPU only (skipped on CPU): a training forward and backward asks the host to wait for the GPU nowhere, so
the host can queue the next step while the GPU still runs this one (PerfOptions.sync_free_mask)."""
import pytest
import torch

from training.model import CausalLMLoss, build_model, llama_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _step(sync_free: bool):
    model = build_model(llama_config("tiny", 512, 64), 0).cuda()
    loss_module = CausalLMLoss(model, compute_dtype=torch.bfloat16, sync_free_mask=sync_free)
    ids = torch.randint(0, 512, (2, 65), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_module(ids[:, :-1], ids[:, 1:])
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_forward_and_backward_never_wait_for_the_gpu():
    _step(sync_free=True)


def test_without_the_option_transformers_check_waits_for_the_gpu():
    with pytest.raises(RuntimeError, match="synchroniz"):
        _step(sync_free=False)
