"""Checkpointer alone: what a save does first, what a resume restores, and which checkpoints it refuses."""
import pytest
import torch

from training.checkpoint import Checkpointer, TrainState
from training.config import RunSpec, SpecError
from training.distributed import DistContext
from training.model import build_model, llama_config
from training.sink import ListSink


class RecordingSink(ListSink):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def flush(self):
        self.calls.append("sink.flush")


def model_and_optimizer(seed: int):
    model = build_model(llama_config("tiny", 512, 32), seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def checkpointer(output_dir, spec, model, optimizer, sink=None, calls=None):
    calls = calls if calls is not None else []
    return Checkpointer(output_dir, spec=spec, ctx=DistContext(), sink=sink if sink is not None else ListSink(),
                        model=model, optimizer=optimizer, settle=lambda: calls.append("settle"),
                        flush_metrics=lambda: calls.append("flush_metrics"))


def test_save_settles_the_optimizer_and_makes_the_metrics_durable_before_writing(make_spec, tmp_path):
    spec = RunSpec.from_dict(make_spec())
    model, optimizer = model_and_optimizer(0)
    calls = []
    sink = RecordingSink(calls)
    saver = checkpointer(tmp_path, spec, model, optimizer, sink=sink, calls=calls)
    assert saver.enabled and saver.last_path is None and not saver.is_saved(3)
    path = saver.save(3, TrainState(step=3, tokens=384, loss=5.5, val_loss=5.25))
    assert calls == ["settle", "flush_metrics", "sink.flush"]
    assert path == tmp_path / "checkpoints" / "step_00000003" and (path / "model.safetensors").is_file()
    assert sink.events_of("checkpoint") == [{"kind": "checkpoint", "step": 3, "path": str(path)}]
    assert saver.is_saved(3) and not saver.is_saved(4)
    # A checkpointer made later knows the newest checkpoint already there.
    assert checkpointer(tmp_path, spec, model, optimizer).last_path == path


def test_resume_restores_weights_optimizer_and_the_train_state(make_spec, tmp_path):
    spec = RunSpec.from_dict(make_spec())
    model, optimizer = model_and_optimizer(0)
    model(torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    optimizer.step()
    checkpointer(tmp_path, spec, model, optimizer).save(7, TrainState(step=7, tokens=896, wall_offset=1.0,
                                                                      loss=5.5, val_loss=5.25))

    fresh, fresh_optimizer = model_and_optimizer(1)
    sink, state = ListSink(), TrainState()
    path = checkpointer(tmp_path, spec, fresh, fresh_optimizer, sink=sink).resume(state)
    assert path.name == "step_00000007"
    assert (state.step, state.tokens, state.loss, state.val_loss) == (7, 896, 5.5, 5.25)
    assert state.wall_offset >= 1.0
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
    assert fresh_optimizer.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert sink.events_of("resumed") == [{"kind": "resumed", "step": 7, "path": str(path)}]


def test_resume_refuses_another_specs_checkpoint_but_not_a_change_of_speed_settings(make_spec, tmp_path):
    model, optimizer = model_and_optimizer(0)
    checkpointer(tmp_path, RunSpec.from_dict(make_spec()), model, optimizer).save(2, TrainState(step=2))

    faster = RunSpec.from_dict(make_spec(training={"checkpoint_every": 5, "perf": {"prefetch": False}}))
    assert checkpointer(tmp_path, faster, model, optimizer).resume(TrainState()) is not None
    other = RunSpec.from_dict(make_spec(training={"lr": 1e-4}))
    with pytest.raises(SpecError, match=r"written by a different run spec \(training.lr: the checkpoint's 0.003, this "
                                         r"spec's 0.0001\); use another output_dir, or resume=False to start a new "
                                         r"run there"):
        checkpointer(tmp_path, other, model, optimizer).resume(TrainState())


def test_a_checkpoint_whose_spec_predates_val_windows_resumes_with_the_first_windows_only(make_spec, tmp_path):
    """A spec saved before data.val_windows existed validated on the first windows: resuming it with today's
    default ("spread") would change what its val loss means mid-run, so it is refused with the setting to give."""
    from training.checkpoint_files import STATE_FILE

    model, optimizer = model_and_optimizer(0)
    legacy = RunSpec.from_dict(make_spec(data={"val_windows": "first"}))
    path = checkpointer(tmp_path, legacy, model, optimizer).save(2, TrainState(step=2))
    saved = torch.load(path / STATE_FILE, weights_only=False)
    del saved["spec"]["data"]["val_windows"]  # as a checkpoint written before the key existed has it
    torch.save(saved, path / STATE_FILE)

    with pytest.raises(SpecError, match=r"\(data.val_windows: the checkpoint's 'first', this spec's 'spread'\); to "
                                         r'resume it, set data.val_windows to "first"; use another output_dir'):
        checkpointer(tmp_path, RunSpec.from_dict(make_spec()), model, optimizer).resume(TrainState())
    assert checkpointer(tmp_path, legacy, model, optimizer).resume(TrainState()).name == "step_00000002"


def test_a_checkpoint_whose_spec_predates_eos_at_split_resumes_with_the_joined_tokens_only(make_spec, tmp_path):
    """A spec saved before data.eos_at_split existed was tokenized without EOS at a text file's held-out tail:
    resuming it with today's default would train on other tokens mid-run; the refusal names both keys' settings."""
    from training.checkpoint_files import STATE_FILE

    model, optimizer = model_and_optimizer(0)
    legacy = RunSpec.from_dict(make_spec(data={"val_windows": "first", "eos_at_split": False}))
    path = checkpointer(tmp_path, legacy, model, optimizer).save(2, TrainState(step=2))
    saved = torch.load(path / STATE_FILE, weights_only=False)
    for key in ("val_windows", "eos_at_split"):  # as a checkpoint written before the keys existed has it
        del saved["spec"]["data"][key]
    torch.save(saved, path / STATE_FILE)

    with pytest.raises(SpecError, match=r"\(data.eos_at_split: the checkpoint's False, this spec's True; "
                                         r"data.val_windows: .*\); to resume it, set data.val_windows to \"first\" and "
                                         r"data.eos_at_split to false; use another output_dir"):
        checkpointer(tmp_path, RunSpec.from_dict(make_spec()), model, optimizer).resume(TrainState())
    assert checkpointer(tmp_path, legacy, model, optimizer).resume(TrainState()).name == "step_00000002"


def test_without_an_output_dir_nothing_is_resumed_or_saved(make_spec, tmp_path):
    model, optimizer = model_and_optimizer(0)
    saver = checkpointer(None, RunSpec.from_dict(make_spec()), model, optimizer)
    state = TrainState()
    assert not saver.enabled and saver.resume(state) is None and state == TrainState()
    with pytest.raises(RuntimeError, match="no output_dir"):
        saver.save(1, state)
    assert not (tmp_path / "checkpoints").exists()


def test_every_rank_knows_the_checkpoint_rank_0_wrote(make_spec, tmp_path):
    """Whether a final save is due is decided on every rank alike (the save is collective): a rank that
    does not write still records the checkpoint's path."""
    model, optimizer = model_and_optimizer(0)
    other_rank = Checkpointer(tmp_path, spec=RunSpec.from_dict(make_spec()), ctx=DistContext(rank=1), sink=ListSink(),
                              model=model, optimizer=optimizer)
    path = other_rank.save(4, TrainState(step=4))
    assert path == tmp_path / "checkpoints" / "step_00000004" and not path.exists()
    assert other_rank.is_saved(4)


def test_a_spec_saved_before_the_data_keys_existed_has_the_numerics_of_todays_defaults():
    from training.checkpoint import numerics_identity

    today = RunSpec.from_dict({"data": {"val_windows": "first", "eos_at_split": False}}).to_dict()
    before = {**today, "data": {k: today["data"][k] for k in ("corpus", "vocab_size", "seq_len", "val_fraction")}}
    assert numerics_identity(before) == numerics_identity(today)
    # ... except val_windows and eos_at_split, whose defaults changed when they came: a spec without them validated
    # on the first windows, and its text files' training parts ran on into the next file
    for key, value in (("val_windows", "spread"), ("eos_at_split", True)):
        assert numerics_identity(before) != numerics_identity({**today, "data": {**today["data"], key: value}})
    more_processes = {**today, "data": {**today["data"], "num_proc": 16, "max_bad_fraction": 0.01}}
    assert numerics_identity(more_processes) == numerics_identity(today)  # the same tokens
    other_field = {**today, "data": {**today["data"], "text_field": "body"}}
    assert numerics_identity(other_field) != numerics_identity(today)


def test_eos_at_split_counts_only_where_a_text_files_tail_is_cut_off(tmp_path, monkeypatch):
    """A corpus of JSON lines, a run with data.val_corpus and the random corpus tokenize the same with either value:
    a checkpoint of theirs resumes under either; a folder of text files does not."""
    from training.checkpoint import numerics_identity

    (tmp_path / "docs.jsonl").write_text('{"text": "a document"}\n')
    (tmp_path / "book.txt").write_text("a book\n")
    cases = {"jsonl": {"corpus": str(tmp_path / "docs.jsonl")},
             "val_corpus": {"corpus": str(tmp_path / "book.txt"), "val_corpus": str(tmp_path / "docs.jsonl")},
             "random": {"corpus": "random", "vocab_size": 512}}
    for name, data in cases.items():
        ids = [numerics_identity(RunSpec.from_dict({"data": {**data, "eos_at_split": v}}).to_dict())
               for v in (True, False)]
        assert ids[0] == ids[1], name
    text = [numerics_identity(RunSpec.from_dict({"data": {"corpus": str(tmp_path / "book.txt"), "eos_at_split": v}})
                              .to_dict()) for v in (True, False)]
    assert text[0] != text[1]

