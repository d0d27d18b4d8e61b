"""Our stored numbers are lm-eval's numbers: the same checkpoint and limit through the
`lm_eval` command line (`--include_path` on the rendered task directory) give the same
metrics, stderrs, task hashes and per-sample scores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from training.evaluation import SHIPPED_TASKS, render_task_dirs


@pytest.mark.slow
def test_lm_eval_command_line_prints_the_numbers_we_store(tiny_checkpoint, shipped_results, tmp_path):
    rendered = render_task_dirs(tmp_path / "tasks")
    out = tmp_path / "cli-output"
    command = [
        str(Path(sys.executable).parent / "lm_eval"), "run",
        "--model", "hf",
        "--model_args", f"pretrained={tiny_checkpoint}",
        "--include_path", ",".join(str(p) for p in rendered.include_paths),
        "--tasks", ",".join(SHIPPED_TASKS),
        "--limit", str(shipped_results["limit"]),
        "--batch_size", str(shipped_results["batch_size"]),
        "--device", "cpu",
        "--output_path", str(out),
        "--log_samples",
    ]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]

    (results_file,) = out.rglob("results_*.json")
    cli = json.loads(results_file.read_text())
    ours = shipped_results["tasks"]
    cli_entries = {**cli["results"], **cli.get("groups", {})}
    assert set(ours) == set(cli_entries)
    for name, task in ours.items():
        entry = cli_entries[name]
        for metric, m in task["metrics"].items():
            assert m["value"] == pytest.approx(entry[f"{metric},none"], rel=1e-6), (name, metric)
            cli_stderr = entry.get(f"{metric}_stderr,none")
            if m["stderr"] is None:
                assert cli_stderr in ("N/A", None), (name, metric)
            else:
                assert m["stderr"] == pytest.approx(cli_stderr, rel=1e-6), (name, metric)
        if task["kind"] == "task":
            assert task["task_hash"] == cli["task_hashes"][name], name
            assert task["n_samples"] == cli["n-samples"][name]["effective"]

    compared = set()
    for samples_file in out.rglob("samples_*.jsonl"):
        name = next(t for t in ours if samples_file.name.startswith(f"samples_{t}_20"))
        compared.add(name)
        cli_samples = sorted((json.loads(line) for line in samples_file.open()), key=lambda s: s["doc_id"])
        task = ours[name]
        assert [s["doc_id"] for s in cli_samples] == task["samples"]["doc_id"]
        for metric in task["aggregation"]:
            cli_values = np.array([s[metric] for s in cli_samples], dtype=float)
            np.testing.assert_allclose(np.array(task["samples"][metric]), cli_values, rtol=1e-6, err_msg=f"{name} {metric}")
    assert compared == {name for name, task in ours.items() if task["kind"] == "task"}
