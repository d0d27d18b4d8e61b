"""Runs fp8_triton_interp_checks.py (the fused FP8 cast-transpose against the torch cast) in a subprocess
under Triton's CPU interpreter, which must be switched on before triton is imported."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_under_triton_interpreter

pytest.importorskip("triton")


def test_fused_fp8_cast_transpose_under_the_triton_interpreter():
    run_under_triton_interpreter(Path(__file__).resolve().parent / "fp8_triton_interp_checks.py")
