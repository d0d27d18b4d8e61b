"""Fixtures for the training library tests: a shared cache (tokenizer + shards built once per session)
and a helper that builds small CPU run specs on tinyshakespeare."""
from __future__ import annotations

import copy

import pytest


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


TINY_SPEC = {
    "model": "tiny",
    "data": {"corpus": "tinyshakespeare", "vocab_size": 512, "seq_len": 32, "val_fraction": 0.05},
    "training": {"steps": 12, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "val_every": 0,
                 "val_batches": 2, "device": "cpu"},
    "seed": 0,
    "recipe": "bf16",
}


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("plab-cache")


@pytest.fixture
def make_spec():
    """make_spec(training={"steps": 5}) → a tiny CPU run-spec dict with the overrides merged in."""
    def make(**override):
        return _merge(TINY_SPEC, override)
    return make


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The test machine's 2 cores are shared by parallel suites: a second intra-op thread spins against
    other processes and makes the tiny models several times slower, not faster."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
