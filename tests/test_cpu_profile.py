"""tests/cpu_profile.py, the plugin that records each test's CPU seconds (its own and its waited-for subprocesses')."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_each_test_gets_its_own_and_its_subprocesses_cpu_seconds(tmp_path):
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys, time\n"
        "def spin(s):\n    t = time.process_time()\n    while time.process_time() - t < s: pass\n"
        "def test_self():\n    spin(0.6)\n"
        "def test_child():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 0.6: pass'], check=True)\n"
        "def test_idle():\n    time.sleep(0.3)\n")
    out = tmp_path / "cpu.jsonl"
    env = {**os.environ, "PLAB_CPU_PROFILE": str(out), "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test's own xdist worker: the inner pytest runs without one
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.cpu_profile",
                    str(tmp_path / "test_burn.py")], env=env, cwd=tmp_path, check=True, capture_output=True)
    rows = {r["id"].split("::")[1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["test_self"]["self"] >= 0.55 and rows["test_self"]["children"] < 0.1
    assert rows["test_child"]["children"] >= 0.55 and rows["test_child"]["self"] < 0.5
    assert rows["test_idle"]["self"] + rows["test_idle"]["children"] < 0.2 and rows["test_idle"]["wall"] >= 0.3
    from tests.cpu_profile import summary

    assert rows["test_idle"]["worker"] == "main" and rows["test_idle"]["start"] > rows["test_self"]["start"]
    text = summary(str(out))
    assert text.startswith("3 tests, ") and "last test ended, by worker: main " in text
