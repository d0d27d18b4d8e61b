"""Runs fp8_swiglu_interp_checks.py (fp8_delayed's fused SwiGLU kernel against its torch reference) in a subprocess
under Triton's CPU interpreter, which must be switched on before triton is imported."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_under_triton_interpreter

pytest.importorskip("triton")


def test_fused_swiglu_fp8_kernel_under_the_triton_interpreter():
    run_under_triton_interpreter(Path(__file__).resolve().parent / "fp8_swiglu_interp_checks.py")
