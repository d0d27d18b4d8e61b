"""An evaluation outside a git checkout (a worker in the Docker image, `plab eval` from any folder) prints nothing
of lm-eval's environment report: `simple_evaluate` ran `git describe` with the process's stderr ("fatal: not a git
repository" once per task) and torch's `collect_env` (pip, nvidia-smi: ~0.6 s a task, counted in its time_s), whose
keys never reach our records (`adapter._skip_environment_report_once`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, subprocess, sys
calls = []
real_popen = subprocess.Popen.__init__
def popen(self, args, *a, **k):
    calls.append(args if isinstance(args, str) else [str(x) for x in args])
    return real_popen(self, args, *a, **k)
subprocess.Popen.__init__ = popen
from training.evaluation import evaluate_checkpoint
out = evaluate_checkpoint(sys.argv[1], ["plab_piqa"], limit=2, device="cpu", data_dir=sys.argv[2])
from lm_eval import evaluator
print(json.dumps({"n": out["tasks"]["plab_piqa"]["n_samples"], "calls": calls,
                  "skipped": [getattr(getattr(evaluator, f), "plab_skipped", False) for f in ("add_env_info", "get_git_commit_hash")]}))
"""


def test_an_evaluation_outside_a_git_checkout_starts_no_git_or_collect_env_and_prints_no_fatal(tiny_checkpoint,
                                                                                              tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "GIT_CEILING_DIRECTORIES": str(tmp_path.parent)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_checkpoint), os.environ["PLAB_DATA_DIR"]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["n"] == 2
    started = [c if isinstance(c, str) else " ".join(c) for c in result["calls"]]
    assert not [c for c in started if c.split()[0].endswith(("git", "pip", "nvidia-smi", "conda"))], started
    assert "not a git repository" not in proc.stderr, proc.stderr[-3000:]
    assert result["skipped"] == [True, True]
