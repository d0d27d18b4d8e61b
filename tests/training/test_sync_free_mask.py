"""transformers' packed-sequence check answered without its host sync (PerfOptions.sync_free_mask): the same
losses and gradients in every architecture, the check itself untouched outside the loss module's forward."""
import pytest
import torch
from transformers import masking_utils

from tests.training.tiny_architectures import ARCHITECTURES, VOCAB, tiny_config
from training.model import CausalLMLoss


def _build(arch):
    """As a run builds it (SDPA where the architecture has it, else eager attention)."""
    from training.model import build_model, prepare_for_training
    return build_model(prepare_for_training(tiny_config(arch)), seed=0).eval()


def _loss_and_grads(model, ids, sync_free):
    model.zero_grad()
    loss = CausalLMLoss(model, fused_loss=False, sync_free_mask=sync_free)(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.fixture
def original_calls(monkeypatch):
    """Count the calls that reach transformers' own check (installs the bypass first)."""
    CausalLMLoss(_build("llama"))
    wrapper = masking_utils.find_packed_sequence_indices
    assert wrapper.plab_bypass
    calls = []
    original = wrapper.__wrapped__

    def spy(position_ids):
        calls.append(position_ids.shape)
        return original(position_ids)
    monkeypatch.setattr(wrapper, "__wrapped__", spy)
    return calls


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_same_loss_and_gradients_with_and_without_the_check(arch, original_calls):
    model = _build(arch)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    slow_loss, slow_grads = _loss_and_grads(model, ids, sync_free=False)
    reached = len(original_calls)
    fast_loss, fast_grads = _loss_and_grads(model, ids, sync_free=True)
    assert len(original_calls) == reached          # the sync-free forward never ran transformers' check
    assert torch.equal(fast_loss, slow_loss)
    assert len(fast_grads) == len(slow_grads) and all(torch.equal(a, b) for a, b in zip(fast_grads, slow_grads))


def test_the_llama_forward_reaches_the_check_without_the_option(original_calls):
    """The spy sees what the option removes: otherwise the test above would pass for a model without the check."""
    model = _build("llama")
    ids = torch.randint(0, VOCAB, (2, 9))
    _loss_and_grads(model, ids, sync_free=False)
    assert original_calls == [torch.Size([2, 8])]


def test_outside_the_loss_module_packed_positions_are_still_detected(original_calls):
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    assert masking_utils.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert masking_utils.find_packed_sequence_indices(torch.arange(8)[None]) is None
    assert len(original_calls) == 2


def test_the_option_is_a_validated_perf_switch():
    from training.config import RunSpec, SpecError
    base = {"model": "tiny", "data": {"corpus": "random", "vocab_size": 512, "seq_len": 32},
            "training": {"steps": 1, "warmup_steps": 0, "device": "cpu"}, "recipe": "bf16"}
    assert RunSpec.from_dict(base).training.perf.sync_free_mask is True
    off = {**base, "training": {**base["training"], "perf": {"sync_free_mask": False}}}
    assert RunSpec.from_dict(off).training.perf.sync_free_mask is False
    bad = {**base, "training": {**base["training"], "perf": {"sync_free_mask": "yes"}}}
    with pytest.raises(SpecError, match="sync_free_mask"):
        RunSpec.from_dict(bad)


@pytest.mark.parametrize("sync_free", [True, False])
def test_compiled_whole_the_loss_module_keeps_sdpa_causal_without_a_mask(sync_free):
    """compile_scope "model": while Dynamo traces, transformers cannot look at the positions and builds a full
    mask (SDPA's causal kernels then do not apply); with the option the traced attention is `is_causal=True`."""
    import torch._dynamo

    loss_module = CausalLMLoss(_build("llama"), fused_loss=False, sync_free_mask=sync_free)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))
    explained = torch._dynamo.explain(loss_module)(ids[:, :-1], ids[:, 1:])
    assert explained.graph_break_count == 0
    calls = [n for g in explained.graphs for n in g.graph.nodes
             if n.target is torch.nn.functional.scaled_dot_product_attention]
    assert len(calls) == 2  # one per block
    for call in calls:
        assert (call.kwargs["attn_mask"] is None and call.kwargs["is_causal"]) is sync_free
