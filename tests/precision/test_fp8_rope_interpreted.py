"""Runs fp8_rope_interp_checks.py (fp8_delayed's fused QKV projection's backward kernel against its torch reference)
in a subprocess under Triton's CPU interpreter, which must be switched on before triton is imported."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_under_triton_interpreter

pytest.importorskip("triton")


def test_rope_backward_fp8_kernel_under_the_triton_interpreter():
    run_under_triton_interpreter(Path(__file__).resolve().parent / "fp8_rope_interp_checks.py")
