"""Runs nvfp4_swiglu_interp_checks.py (NVFP4's fused SwiGLU kernel and MLP function against their references) in a
subprocess under Triton's CPU interpreter, which must be switched on before triton is imported."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_under_triton_interpreter

pytest.importorskip("triton")


def test_fused_nvfp4_swiglu_under_the_triton_interpreter():
    run_under_triton_interpreter(Path(__file__).resolve().parent / "nvfp4_swiglu_interp_checks.py")
