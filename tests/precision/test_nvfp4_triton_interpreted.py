"""Runs nvfp4_triton_interp_checks.py (the fused NVFP4 kernels against the torch quantizers) in a
subprocess under Triton's CPU interpreter, which must be switched on before triton is imported."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_under_triton_interpreter

pytest.importorskip("triton")


def test_fused_nvfp4_kernels_under_the_triton_interpreter():
    run_under_triton_interpreter(Path(__file__).resolve().parent / "nvfp4_triton_interp_checks.py")
