"""`python -m training` as one process (several: test_fsdp.py, `plab train` under torchrun), and what it says
about a bad spec."""
import json
import os
import subprocess
import sys

import pytest

from training import launch


def test_python_dash_m_training_trains_a_spec_file_and_writes_metrics_and_result(make_spec, tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps(make_spec(training={"steps": 3})))
    env = dict(os.environ, PLAB_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "training", str(tmp_path / "spec.json"), "--output-dir", str(tmp_path / "out"),
           "--metrics-jsonl", str(tmp_path / "m.jsonl"), "--result-json", str(tmp_path / "result.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["status"], result["steps"], result["summary"]["world_size"]) == ("succeeded", 3, 1)
    assert result["checkpoint_dir"] == str(tmp_path / "out" / "checkpoints" / "step_00000003")
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["type"] == "metrics" and "train/loss" in x["metrics"]] == [1, 2, 3]
    assert lines[-1]["kind"] == "result"

    # Run again: resumes from the final checkpoint, trains nothing, and reports the same run.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((tmp_path / "result.json").read_text())
    assert (again["steps"], again["final_loss"]) == (3, result["final_loss"])


@pytest.mark.parametrize("content,message", [
    (None, "cannot read the run spec"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"model": "tiny", "data": {"corpus": "tinyshakespeare"}, "training": {"steps": -1}}',
     "training.steps"),
])
def test_a_bad_spec_file_is_a_usage_error_that_says_what_is_wrong(tmp_path, capsys, content, message):
    path = tmp_path / "spec.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        launch.main([str(path), "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err


@pytest.mark.parametrize("extra, message", [
    (["--output-dir", "{blocker}/out"], "--output-dir {blocker}/out: cannot create the folder {blocker}/out"),
    (["--output-dir", "{tmp}/out", "--metrics-jsonl", "{blocker}/m/x.jsonl"],
     "--metrics-jsonl {blocker}/m/x.jsonl: cannot create the folder {blocker}/m"),
    (["--output-dir", "{tmp}/out", "--result-json", "{tmp}"],
     "--result-json {tmp}: {tmp} is a folder; give a file name"),
])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(make_spec, tmp_path, capsys, monkeypatch,
                                                                         extra, message):
    (tmp_path / "spec.json").write_text(json.dumps(make_spec(training={"steps": 3})))
    (tmp_path / "blocker").write_text("a file where a folder would go")
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("the run started"))
    fill = {"blocker": str(tmp_path / "blocker"), "tmp": str(tmp_path)}
    with pytest.raises(SystemExit) as exit_info:
        launch.main([str(tmp_path / "spec.json")] + [x.format(**fill) for x in extra])
    assert exit_info.value.code == 2
    assert message.format(**fill) in capsys.readouterr().err


def test_a_corpus_problem_found_when_the_run_opens_it_is_one_line_and_status_2(make_spec, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"content": f"line {i} " * 20}) + "\n" for i in range(50)))
    spec = make_spec(data={"corpus": str(corpus), "vocab_size": 512}, training={"steps": 2})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert launch.main([str(tmp_path / "spec.json"), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"python -m training: error: {tmp_path / 'spec.json'}: {corpus}:1: the line has no "
                   f"field 'text' (fields: ['content']); set data.text_field to the field that holds the text, or "
                   f"fix the line\n")
