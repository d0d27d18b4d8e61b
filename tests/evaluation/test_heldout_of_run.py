"""`plab eval` on a checkpoint folder of the lab scores plab_heldout_bpb on the run's own validation text, made from
the run spec in the folder's run_spec.json as the worker makes it - not on a whole corpus file that the run
mostly trained on (the default for any other folder, with its warning)."""
from __future__ import annotations

from pathlib import Path

from training.evaluation import evaluate_checkpoint
from training.checkpoint_files import RUN_SPEC_FILE, STATE_FILE
from training.evaluation.heldout import checkpoint_spec, validation_text
from training.train import train

SPEC = {"model": "tiny", "data": {"corpus": "tinyshakespeare", "vocab_size": 512, "seq_len": 32, "val_fraction": 0.05},
        "training": {"steps": 2, "batch_size": 2, "lr": 3e-3, "warmup_steps": 1, "val_every": 0, "val_batches": 1,
                     "device": "cpu"},
        "seed": 0, "recipe": "bf16"}


def test_a_lab_checkpoint_is_scored_on_its_runs_validation_text(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("PLAB_HOME", str(home))
    monkeypatch.delenv("PLAB_EVAL_HELDOUT_TEXT", raising=False)
    result = train(SPEC, output_dir=tmp_path / "run", cache_dir=home / "cache")
    checkpoint = result.checkpoint_dir
    spec = checkpoint_spec(checkpoint)
    assert spec["data"]["corpus"] == "tinyshakespeare" and spec["data"]["val_windows"] == "spread"
    assert checkpoint_spec(tmp_path) is None  # not a checkpoint folder of the lab
    # an older checkpoint (its spec only in the pickled state, which an evaluation does not unpickle): no spec
    old = tmp_path / "old"
    old.mkdir()
    (old / STATE_FILE).write_bytes((Path(checkpoint) / STATE_FILE).read_bytes())
    assert checkpoint_spec(old) is None and (Path(checkpoint) / RUN_SPEC_FILE).is_file()

    kw = dict(limit=2, device="cpu", batch_size=8, bootstrap_iters=0)
    capsys.readouterr()
    own = evaluate_checkpoint(checkpoint, ["plab_heldout_bpb"], **kw)
    err = capsys.readouterr().err
    (made,) = (home / "cache" / "heldout").glob("*-spread-400000.txt")  # named by the token cache it decodes
    assert "plab_heldout_bpb scores the run's own validation text" in err and str(made) in err
    assert "most of it is training text" not in err
    # the worker's text, byte for byte (the same function on the same spec), and the same score as when given
    worker_text = validation_text(spec, tmp_path / "worker" / "validation_spread.txt")
    assert (tmp_path / "worker" / "validation_spread.txt").read_text() == made.read_text() and worker_text
    given = evaluate_checkpoint(checkpoint, ["plab_heldout_bpb"], heldout_text=made, **kw)

    def bpb(r):
        return r["tasks"]["plab_heldout_bpb"]["metrics"]["bits_per_byte"]["value"]

    assert bpb(own) == bpb(given)
    assert own["tasks"]["plab_heldout_bpb"]["eval_settings"]["rolling_context"] == 32
    # given a text, it is used as before: no spec is read for it
    capsys.readouterr()
    other = tmp_path / "other.txt"
    other.write_text("A short held-out text, not the run's.\n" * 40)
    elsewhere = evaluate_checkpoint(checkpoint, ["plab_heldout_bpb"], heldout_text=other, **kw)
    assert bpb(elsewhere) != bpb(own) and "own validation text" not in capsys.readouterr().err
