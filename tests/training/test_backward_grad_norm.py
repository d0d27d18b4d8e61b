"""training.optim.BackwardGradNorm: the per-tensor gradient norms taken during the backward must be exactly the
ones clip_gradients takes after it, for the final gradients of the step only."""
import pytest
import torch

from training.optim import BackwardGradNorm
from training.sink import ListSink
from training.train import train


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 50))


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (8, 6), generator=g)
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten())


def _after_backward(params):
    return torch._foreach_norm([p.grad for p in params if p.grad is not None], 2.0, dtype=torch.float32)


def _groups(model):
    return [list(model[0].parameters()), list(model[1].parameters()), list(model[3].parameters())]


def test_norms_of_the_last_micro_batch_equal_the_norms_taken_after_the_backward():
    model = _model()
    params = list(model.parameters())
    tracker = BackwardGradNorm(_groups(model), params, torch.device("cpu"))
    _loss(model, 1).backward()           # an earlier micro-batch: accumulating, not counted
    tracker.arm()
    _loss(model, 2).backward()           # the last one: gradients final when each group's last one lands
    early = dict(tracker.norms)
    assert len(early) == len(params)     # every group's norms were taken inside the backward
    got = tracker.collect()
    want = _after_backward(params)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_gradients_of_an_unarmed_backward_are_not_taken():
    model = _model()
    params = list(model.parameters())
    tracker = BackwardGradNorm(_groups(model), params, torch.device("cpu"))
    _loss(model, 1).backward()
    assert tracker.norms == {}
    tracker.arm()
    _loss(model, 2).backward()
    for p in params:                     # the first backward's gradients alone: different norms
        p.grad = None
    _loss(model, 2).backward()
    assert not all(torch.equal(tracker.norms[id(p)], n) for p, n in zip(params, _after_backward(params)))


def test_a_gradient_set_outside_autograd_and_a_missing_one_are_handled_in_collect():
    model = _model()
    params = list(model.parameters())
    tracker = BackwardGradNorm(_groups(model), params, torch.device("cpu"))
    tracker.arm()
    _loss(model, 3).backward()
    model[1].bias.grad = torch.full_like(model[1].bias, 3.0)   # replaced after its norm was taken
    del tracker.norms[id(model[1].bias)]
    model[3].bias.grad = None                                  # a parameter with no gradient this step
    got = tracker.collect()
    want = _after_backward(params)
    assert len(got) == len(params) - 1 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_groups_must_cover_every_parameter_once():
    model = _model()
    params = list(model.parameters())
    with pytest.raises(ValueError, match="exactly once"):
        BackwardGradNorm(_groups(model)[:2], params, torch.device("cpu"))
    with pytest.raises(ValueError, match="exactly once"):
        BackwardGradNorm(_groups(model) + [[params[0]]], params, torch.device("cpu"))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_training_with_the_norms_taken_in_the_backward_is_bit_identical(make_spec, cache_dir, grad_accum):
    runs = {}
    for on in (True, False):
        sink = ListSink()
        train(make_spec(training={"steps": 6, "batch_size": 8, "grad_accum": grad_accum, "grad_clip": 0.05,
                                  "perf": {"backward_grad_norm": on}}), sink, cache_dir=cache_dir)
        runs[on] = ([v for _, v in sink.series("train/loss")], [v for _, v in sink.series("train/grad_norm")])
    assert runs[True] == runs[False]
    assert min(runs[True][1]) > 0.05    # every step clipped: the norm decided each update
