"""bench/train_bench.py loaded as a module (it is a script, not a package member) for its tests."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_bench_script", REPO / "bench" / "train_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
