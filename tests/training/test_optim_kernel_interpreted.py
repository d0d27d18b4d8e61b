"""Runs optim_kernel_interp_checks.py (MasterAdamW's Triton update against the eager one) in a subprocess
under Triton's CPU interpreter, which must be switched on before triton is imported."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_under_triton_interpreter

pytest.importorskip("triton")


def test_triton_adamw_update_under_the_triton_interpreter():
    run_under_triton_interpreter(Path(__file__).resolve().parent / "optim_kernel_interp_checks.py")
