"""Runs nvfp4_triton_interp_checks.py (the fused NVFP4 kernels against the torch quantizers) in a
subprocess under Triton's CPU interpreter, which must be switched on before triton is imported."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


def test_fused_nvfp4_kernels_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(HERE / "nvfp4_triton_interp_checks.py")],
                          env=env, cwd=HERE.parent.parent, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.split("\n")[-2], tail
