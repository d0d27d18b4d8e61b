"""training.quiet: the two third-party log lines dropped, every other record of those loggers kept."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from training import quiet

CUDA_LIBRARY = "Failed to load /v/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load"


def record(name: str, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, message, None, None)


def test_torchaos_cuda_library_line_dropped_only_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert quiet.torchao_cuda_library_on_cpu_build(record("torchao", CUDA_LIBRARY))
    cutlass = CUDA_LIBRARY.replace("_C_mxfp8.cpython-310-x86_64-linux-gnu", "_C_cutlass_90a.abi3")
    assert quiet.torchao_cuda_library_on_cpu_build(record("torchao", cutlass))
    # another library, or another message: kept
    other = CUDA_LIBRARY.replace("_C_mxfp8", "_C_cpu_kernels")
    assert not quiet.torchao_cuda_library_on_cpu_build(record("torchao", other))
    assert not quiet.torchao_cuda_library_on_cpu_build(record("torchao", "Skipping import of cpp extensions"))
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # with CUDA the failure means something: kept
    assert not quiet.torchao_cuda_library_on_cpu_build(record("torchao", CUDA_LIBRARY))


def test_filters_installed_once_and_pass_other_records():
    quiet.install()
    quiet.install()
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        assert len([f for f in logger.filters if isinstance(f, quiet._Drop)]) == 1
        assert logger.filter(record(name, "something else went wrong"))
    assert not logging.getLogger("torch.utils._pytree").filter(record(
        "torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
        "torch.compile as an opaque value type."))


def stderr_of(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=True).stderr


@pytest.mark.skipif(torch.version.cuda is not None, reason="torchao's CUDA libraries load under a CUDA build")
def test_importing_a_recipe_prints_neither_line():
    bare = stderr_of("import torchao.prototype.mx_formats, torchao.float8")
    if "Failed to load" not in bare and "Enum subclass" not in bare:
        pytest.skip("this torch/torchao pair logs neither line; nothing to drop")
    ours = stderr_of("import training.precision.nvfp4, training.precision.mxfp8, training.precision.fp8_tensorwise")
    assert "Failed to load" not in ours and "Enum subclass" not in ours, ours
