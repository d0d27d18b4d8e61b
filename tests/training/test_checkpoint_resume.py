"""HF checkpoints that plain transformers loads, atomic writes, and exact resume."""
import json

import pytest
import torch

from training import checkpoint as ckpt
from training.sink import ListSink
from training.train import train


class Crash(RuntimeError):
    pass


def _losses(sink):
    return dict(sink.series("train/loss"))


@pytest.mark.parametrize("recipe", ["bf16", "fp8_delayed"])  # fp8_delayed: the amax history must resume too
def test_interrupted_run_resumes_to_the_same_loss_at_every_later_step(make_spec, cache_dir, tmp_path, recipe):
    spec = make_spec(training={"steps": 12, "checkpoint_every": 4, "val_every": 6}, recipe=recipe)
    reference = ListSink()
    train(spec, reference, output_dir=tmp_path / "uninterrupted", cache_dir=cache_dir)

    calls = []

    def crash_during_step_7():   # a worker dying mid-run: an exception, not a clean cancel
        calls.append(1)
        if len(calls) == 7:
            raise Crash("killed")
        return False
    first = ListSink()
    with pytest.raises(Crash):
        train(spec, first, should_stop=crash_during_step_7, output_dir=tmp_path / "run", cache_dir=cache_dir)
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step_00000004"

    resumed = ListSink()
    result = train(spec, resumed, output_dir=tmp_path / "run", cache_dir=cache_dir)
    assert result.status == "succeeded" and result.steps == 12 and result.tokens == 12 * 4 * 32
    assert resumed.events_of("resumed")[0]["step"] == 4
    after = _losses(resumed)
    assert sorted(after) == list(range(5, 13))   # continues the series: no gap, nothing re-logged before 5
    want = _losses(reference)
    for step, loss in after.items():
        assert loss == pytest.approx(want[step], abs=1e-6), step
    assert dict(resumed.series("val/loss"))[12] == pytest.approx(dict(reference.series("val/loss"))[12], abs=1e-6)


def test_finished_run_checkpoint_loads_with_plain_transformers_and_gives_the_same_loss(make_spec, cache_dir,
                                                                                         tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.config import RunSpec
    from training.data import TokenDataset
    from training.tokenizer import get_tokenizer

    result = train(make_spec(training={"steps": 6}), ListSink(), output_dir=tmp_path, cache_dir=cache_dir)
    path = result.checkpoint_dir
    assert path.endswith("step_00000006")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 512 and tok.eos_token == "<|endoftext|>"
    assert json.loads((tmp_path / "checkpoints" / "step_00000006" / "config.json").read_text())[
        "architectures"] == ["LlamaForCausalLM"]
    # The trainer's final validation loss, recomputed from the checkpoint with HF's own forward.
    spec = RunSpec.from_dict(make_spec())
    ds = TokenDataset.from_corpus(spec.data.corpus_dir(), get_tokenizer(spec.data.corpus_dir(), 512, cache_dir),
                                  seq_len=32, val_fraction=0.05, cache_dir=cache_dir)
    windows = ds.val_windows(2 * 4)
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert loss.item() == pytest.approx(result.final_val_loss, abs=1e-5)


def test_a_kill_mid_write_never_leaves_a_broken_latest_checkpoint(make_spec, cache_dir, tmp_path, monkeypatch):
    train(make_spec(training={"steps": 2}), ListSink(), output_dir=tmp_path, cache_dir=cache_dir)
    good = ckpt.latest_checkpoint(tmp_path)

    def die(*a, **k):
        raise Crash("killed while writing the training state")
    monkeypatch.setattr(ckpt.torch, "save", die)
    with pytest.raises(Crash):
        train(make_spec(training={"steps": 4}), ListSink(), output_dir=tmp_path / "second", cache_dir=cache_dir)
    assert ckpt.latest_checkpoint(tmp_path / "second") is None
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "second" / "checkpoints").iterdir())
    assert ckpt.latest_checkpoint(tmp_path) == good


def test_resuming_under_a_different_spec_is_refused(make_spec, cache_dir, tmp_path):
    from training.config import SpecError
    train(make_spec(training={"steps": 2}), ListSink(), output_dir=tmp_path, cache_dir=cache_dir)
    with pytest.raises(SpecError, match="different run spec"):
        train(make_spec(training={"steps": 2}, seed=1), ListSink(), output_dir=tmp_path, cache_dir=cache_dir)
