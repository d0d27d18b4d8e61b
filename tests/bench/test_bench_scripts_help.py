"""The GPU-only bench scripts import and parse their arguments on a CPU machine (`--help`): a broken import or
argument table shows here, not at the start of a paid GPU call."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["carveout_probe.py", "kernel_bench.py"])
def test_gpu_bench_script_imports_and_prints_its_usage(script):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout and "--" in proc.stdout
