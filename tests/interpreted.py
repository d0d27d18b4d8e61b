"""Running a test file under Triton's CPU interpreter. TRITON_INTERPRET=1 must be set before triton is first
imported, so each file of interpreter checks runs in its own pytest subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_under_triton_interpreter(path: Path, timeout_s: float = 600) -> None:
    """Runs the pytest file `path` with TRITON_INTERPRET=1; fails with its output unless every test passed.
    Then compiles every kernel launch it made for sm_90 (tests/triton_launches.py: the interpreter accepts code
    the GPU compiler rejects)."""
    from tests.triton_launches import RECORD_ENV, compile_for_sm90

    with tempfile.TemporaryDirectory() as tmp:
        launches = Path(tmp) / "launches.jsonl"
        env = {**os.environ, "TRITON_INTERPRET": "1", RECORD_ENV: str(launches)}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                               "tests.triton_launches", str(path)],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        tail = (proc.stdout + proc.stderr)[-4000:]
        assert proc.returncode == 0, tail
        assert " passed" in tail and "skipped" not in tail.split("\n")[-2], tail
        assert launches.exists(), "no Triton kernel was launched"
        assert compile_for_sm90(launches) > 0


def require_interpreter(runner: str) -> None:
    """Skips the calling module (a file of interpreter checks) unless TRITON_INTERPRET=1, as `runner`, the test
    that starts it in a subprocess, sets it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(f"runs under TRITON_INTERPRET=1, in a subprocess started by {runner}", allow_module_level=True)
