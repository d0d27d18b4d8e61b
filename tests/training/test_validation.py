"""ValidationLoss alone: the mean over every window, whatever the micro-batch; eval mode only meanwhile."""
import pytest
import torch

from training.model import CausalLMLoss, build_model, llama_config
from training.validation import ValidationLoss


@pytest.fixture
def tiny():
    model = build_model(llama_config("tiny", 512, 32), 0)
    model.train()
    windows = torch.randint(0, 512, (7, 33), generator=torch.Generator().manual_seed(0))
    return model, CausalLMLoss(model), windows


def test_the_loss_is_the_mean_over_all_windows_in_any_micro_batch_size(tiny):
    model, net, windows = tiny
    with torch.no_grad():
        model.eval()
        want = net(windows[:, :-1], windows[:, 1:]).item()  # one batch: every token weighs the same
        model.train()
    settled = []
    validation = ValidationLoss(net, model, windows, micro_batch=3, device=torch.device("cpu"),
                                settle=lambda: settled.append(1))
    assert validation.loss() == pytest.approx(want, rel=1e-6)
    assert settled == [1] and model.training  # the update in flight was waited for; train mode is back


def test_no_windows_no_loss(tiny):
    model, net, windows = tiny
    settled = []
    validation = ValidationLoss(net, model, windows[:0], micro_batch=2, device=torch.device("cpu"),
                                settle=lambda: settled.append(1))
    assert validation.loss() is None and settled == []


def test_a_micro_batch_below_one_is_refused(tiny):
    model, net, windows = tiny
    with pytest.raises(ValueError, match="micro_batch must be at least 1, got 0"):
        ValidationLoss(net, model, windows, micro_batch=0, device=torch.device("cpu"))


def test_a_run_whose_validation_split_holds_no_window_is_refused_before_it_trains(make_spec, cache_dir):
    """A validation split shorter than one window ended the run 'succeeded' with no validation loss, the one its
    verdict is judged on (a review); val_batches = 0 (benchmarks) still trains without validation."""
    from training.config import SpecError
    from training.sink import ListSink
    from training.train import train

    short = {"data": {"seq_len": 512, "val_fraction": 0.0005}, "training": {"steps": 2, "batch_size": 2,
                                                                           "warmup_steps": 1}}
    with pytest.raises(SpecError, match=r"the validation split has \d+ tokens, fewer than one window of "
                                        r"data.seq_len \+ 1 = 513; raise data.val_fraction"):
        train(make_spec(**short), ListSink(), cache_dir=cache_dir)
    result = train(make_spec(**{**short, "training": {**short["training"], "val_batches": 0}}), ListSink(),
                   cache_dir=cache_dir)
    assert result.status == "succeeded" and result.final_val_loss is None
