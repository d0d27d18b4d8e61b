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


# fp8_delayed: the amax history must resume too. param_dtype bf16: BF16 parameters with FP32 masters in the
# optimizer (the GPU default): the masters, not the rounded parameters, must come back.
# fuse_qkv: the fused projection is split into HF's q/k/v weights in the checkpoint and joined again.
# fuse_gate_up: likewise for the MLP's gate/up projection.
@pytest.mark.parametrize("recipe,param_dtype,fuse", [("bf16", "fp32", False), ("fp8_delayed", "fp32", False),
                                                      ("bf16", "bf16", True)])
def test_interrupted_run_resumes_to_the_same_loss_at_every_later_step(make_spec, cache_dir, tmp_path, recipe,
                                                                       param_dtype, fuse):
    spec = make_spec(training={"steps": 12, "checkpoint_every": 4, "val_every": 6, "param_dtype": param_dtype,
                               "perf": {"fuse_qkv": fuse, "fuse_gate_up": fuse}}, recipe=recipe)
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


@pytest.mark.parametrize("fuse", [False, True])
def test_finished_run_checkpoint_loads_with_plain_transformers_and_gives_the_same_loss(make_spec, cache_dir,
                                                                                         tmp_path, fuse):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.config import RunSpec
    from training.data import TokenDataset
    from training.tokenizer import get_tokenizer

    result = train(make_spec(training={"steps": 6, "perf": {"fuse_qkv": fuse, "fuse_gate_up": fuse}}), ListSink(),
                   output_dir=tmp_path, cache_dir=cache_dir)
    assert result.summary["fused_qkv"] is fuse and result.summary["fused_gate_up"] is fuse
    path = result.checkpoint_dir
    assert path.endswith("step_00000006")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 512 and tok.eos_token == "<|endoftext|>"
    config = json.loads((tmp_path / "checkpoints" / "step_00000006" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["plab_trained_context"] == 32  # data.seq_len: where evaluation windows perplexity tasks
    # The trainer's final validation loss, recomputed from the checkpoint with HF's own forward.
    spec = RunSpec.from_dict(make_spec())
    ds = TokenDataset.from_corpus(spec.data.corpus_dir(), get_tokenizer(spec.data.corpus_dir(), 512, cache_dir),
                                  seq_len=32, val_fraction=0.05, cache_dir=cache_dir)
    windows = ds.val_windows(2 * 4)
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert loss.item() == pytest.approx(result.final_val_loss, abs=1e-5)


def test_bf16_parameter_run_checkpoints_its_fp32_masters(make_spec, cache_dir, tmp_path):
    """The HF weights of a BF16-parameter run are the optimizer's FP32 masters (not BF16-rounded), and the
    model's BF16 parameters are exactly those masters rounded to nearest."""
    from safetensors.torch import load_file

    from training.config import RunSpec
    from training.model import build_model, llama_config

    result = train(make_spec(training={"steps": 3, "param_dtype": "bf16"}), ListSink(), output_dir=tmp_path,
                   cache_dir=cache_dir)
    assert result.summary["param_dtype"] == "bf16" and result.gemm_backend == "bf16"  # BF16 GEMMs on the CPU too
    weights = load_file(str(tmp_path / "checkpoints" / "step_00000003" / "model.safetensors"))
    w = weights["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.float32
    assert not torch.equal(w, w.to(torch.bfloat16).float())  # FP32 detail survived: masters, not params
    state = torch.load(tmp_path / "checkpoints" / "step_00000003" / ckpt.STATE_FILE, weights_only=False)
    masters = [s["master"] for s in state["optimizer"]["state"].values()]
    assert all(m.dtype == torch.float32 for m in masters)
    # After 3 steps the weights moved away from the FP32 initialisation.
    spec = RunSpec.from_dict(make_spec())
    init = build_model(llama_config(spec.model, spec.vocab_size, spec.data.seq_len), spec.seed)
    assert not torch.equal(init.state_dict()["model.layers.0.mlp.down_proj.weight"], w)


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


def test_resuming_after_the_corpus_changed_is_refused(make_spec, cache_dir, tmp_path):
    """The spec names a folder; a file added to it since the checkpoint retrains the tokenizer and reorders the
    tokens (a review: 234 of 512 ids changed meaning and the run went on, its loss jumping). Refused, with what
    changed; the same data resumes as before."""
    from training.config import SpecError, data_root

    source = (data_root() / "tinyshakespeare" / "input.txt").read_text()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(source[:300_000])
    (corpus / "b.txt").write_text(source[300_000:600_000])
    spec = make_spec(data={"corpus": str(corpus)}, training={"steps": 4, "checkpoint_every": 2})
    calls = []

    def crash_during_step_3():
        calls.append(1)
        if len(calls) == 3:
            raise Crash("killed")
        return False
    with pytest.raises(Crash):
        train(spec, ListSink(), output_dir=tmp_path / "out", cache_dir=cache_dir, should_stop=crash_during_step_3)
    assert ckpt.latest_checkpoint(tmp_path / "out").name == "step_00000002"
    (corpus / "c.txt").write_text(source[600_000:900_000])
    with pytest.raises(SpecError, match=r"was trained on other data: the corpus the spec names now gives token cache "
                                        r"\w+-v512\S*, the checkpoint's was \w+-v512\S* \(a file of data.corpus"):
        train(spec, ListSink(), output_dir=tmp_path / "out", cache_dir=cache_dir)
    (corpus / "c.txt").unlink()
    resumed = ListSink()
    train(spec, resumed, output_dir=tmp_path / "out", cache_dir=cache_dir)
    assert sorted(_losses(resumed)) == [3, 4]  # resumed after step 2
