"""bench/train_bench.py imported as a module (bench/ is on sys.path through the repo root) for its tests."""
import importlib

import pytest


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("bench.train_bench")
