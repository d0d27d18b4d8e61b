"""Two third-party log lines that tell a user of this project nothing, dropped at their loggers.

- torchao's "Failed to load .../torchao/_C_mxfp8...so" and "..._C_cutlass_90a...so" on a PyTorch without CUDA:
  both libraries are CUDA kernels (they link libtorch_cuda), so on a CPU build they cannot load, by design;
  torchao runs its Python paths instead. With CUDA present the line is kept: there it means something.
- torch's "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile ...":
  a deprecation notice to torchao's authors (torchao registers its enums as pytree constants).

Filters on the named loggers only, installed once by `import training`; every other record of these loggers
passes. Nothing here imports torch or torchao.
"""
from __future__ import annotations

import logging
import sys

_TORCHAO_CUDA_LIBRARIES = ("_C_mxfp8", "_C_cutlass")


def _torch_has_cuda() -> bool:
    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None)
    return version is not None


def torchao_cuda_library_on_cpu_build(record: logging.LogRecord) -> bool:
    """torchao could not load one of its CUDA kernel libraries into a PyTorch built without CUDA."""
    message = record.getMessage()
    if not message.startswith("Failed to load "):
        return False
    library = message[len("Failed to load "):].split(":", 1)[0].rsplit("/", 1)[-1]
    return library.startswith(_TORCHAO_CUDA_LIBRARIES) and not _torch_has_cuda()


def torch_enum_constant_deprecation(record: logging.LogRecord) -> bool:
    return "is an Enum subclass and is now natively supported by torch.compile" in record.getMessage()


class _Drop(logging.Filter):
    def __init__(self, test):
        super().__init__()
        self.test = test

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self.test(record)
        except Exception:  # a record we cannot read is passed on, never lost
            return True


_RULES = {"torchao": torchao_cuda_library_on_cpu_build, "torch.utils._pytree": torch_enum_constant_deprecation}


def install() -> None:
    """Add the filters (idempotent)."""
    for name, test in _RULES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.test is test for f in logger.filters):
            logger.addFilter(_Drop(test))
