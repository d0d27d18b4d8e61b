"""Two processes under torchrun (gloo, CPU) train like one process with the same global batch."""
import json
import os
import subprocess
import sys

import pytest

from training.sink import ListSink
from training.train import train


@pytest.mark.slow
def test_two_process_gloo_run_matches_the_single_process_run(make_spec, cache_dir, tmp_path):
    base = make_spec(training={"steps": 6, "batch_size": 8, "val_every": 3})
    single = ListSink()
    one = train(base, single, cache_dir=cache_dir)

    spec = make_spec(training={"steps": 6, "batch_size": 8, "val_every": 3, "gpus": 2})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PLAB_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "training", str(tmp_path / "spec.json"), "--output-dir", str(tmp_path / "out"),
           "--metrics-jsonl", str(tmp_path / "m.jsonl"), "--result-json", str(tmp_path / "result.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    points = [x for x in lines if x["type"] == "metrics"]
    two_loss = {x["step"]: x["metrics"]["train/loss"] for x in points if "train/loss" in x["metrics"]}
    two_val = {x["step"]: x["metrics"]["val/loss"] for x in points if "val/loss" in x["metrics"]}
    assert sorted(two_loss) == list(range(1, 7))      # rank 0 alone reports: each step exactly once
    for step, loss in single.series("train/loss"):
        assert two_loss[step] == pytest.approx(loss, abs=2e-5), step
    for step, loss in single.series("val/loss"):
        assert two_val[step] == pytest.approx(loss, abs=2e-5), step
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "succeeded" and result["summary"]["world_size"] == 2
    assert result["tokens"] == one.tokens == 6 * 8 * 32
    assert result["checkpoint_dir"].endswith("step_00000006")
