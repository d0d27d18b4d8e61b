"""training.perf.cublaslt_workspace: what the training process's environment says to torch before its first GEMM."""
import dataclasses

import pytest
import torch

from training.config import PerfOptions, RunSpec, SpecError
from training.precision import catalog
from training.setup import configure_cublaslt_workspace

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    monkeypatch.delenv("_PLAB_CUBLASLT_SET", raising=False)


def _perf(value):
    return PerfOptions(cublaslt_workspace=value)


def test_none_drops_the_workspace_on_a_gpu_and_default_leaves_torchs():
    import os
    assert configure_cublaslt_workspace(CUDA, _perf("default")) == "default"
    assert "CUBLASLT_WORKSPACE_SIZE" not in os.environ
    assert configure_cublaslt_workspace(CUDA, _perf("none")) == "none"
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0"


def test_a_later_run_in_the_process_may_choose_again_but_a_users_setting_is_left(monkeypatch):
    import os
    assert configure_cublaslt_workspace(CUDA, _perf("none")) == "none"
    assert configure_cublaslt_workspace(CUDA, _perf("default")) == "default"
    assert "CUBLASLT_WORKSPACE_SIZE" not in os.environ
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "2048")
    assert configure_cublaslt_workspace(CUDA, _perf("none")) == "env"
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "2048"


def test_torchs_workspaces_are_dropped_when_the_size_changes_and_only_then(monkeypatch):
    """torch allocates each (handle, stream)'s cuBLASLt workspace once, at the size of its first call, and hands it
    out again at any later size: a later run in the process that changes the size drops them (after the GPU is idle),
    so none allocated at 0 bytes is handed to a GEMM asking for torch's default 1 MiB."""
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert configure_cublaslt_workspace(CUDA, _perf("default")) == "default"
    assert calls == []  # unchanged: torch's default before and after
    assert configure_cublaslt_workspace(CUDA, _perf("none")) == "none"
    assert calls == ["sync", "clear"]
    assert configure_cublaslt_workspace(CUDA, _perf("none")) == "none"
    assert calls == ["sync", "clear"]  # unchanged
    assert configure_cublaslt_workspace(CUDA, _perf("default")) == "default"
    assert calls == ["sync", "clear"] * 2
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "2048")  # the user's: left alone, nothing dropped
    assert configure_cublaslt_workspace(CUDA, _perf("none")) == "env"
    assert calls == ["sync", "clear"] * 2
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a process before its first GPU call
    assert configure_cublaslt_workspace(CUDA, _perf("none")) == "none"
    assert calls == ["sync", "clear"] * 2


def test_auto_follows_the_recipe_catalog(monkeypatch):
    import os
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert PerfOptions().cublaslt_workspace == "auto"
    for recipe in ("bf16", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4", "no_such_recipe", None):
        assert configure_cublaslt_workspace(CUDA, _perf("auto"), recipe) == "default"
        assert "CUBLASLT_WORKSPACE_SIZE" not in os.environ
    for recipe in ("fp8_delayed", "fp8_tensorwise"):  # curve-tested without it (bench/NOTES_floor.md 67, 69)
        assert catalog.get(recipe).cublaslt_workspace == "none"
        assert configure_cublaslt_workspace(CUDA, _perf("auto"), recipe) == "none"
        assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0"
        # an explicit choice wins over auto's
        assert configure_cublaslt_workspace(CUDA, _perf("default"), recipe) == "default"
        assert "CUBLASLT_WORKSPACE_SIZE" not in os.environ
        assert configure_cublaslt_workspace(CPU, _perf("auto"), recipe) == "default"


def test_auto_keeps_the_workspace_where_the_recipe_runs_emulated(monkeypatch):
    """On an A100 (sm_80) fp8_delayed and fp8_tensorwise run BF16 GEMMs on emulated operands: their measured
    choice does not apply there."""
    import os
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    for recipe in ("fp8_delayed", "fp8_tensorwise"):
        assert configure_cublaslt_workspace(CUDA, _perf("auto"), recipe) == "default"
        assert "CUBLASLT_WORKSPACE_SIZE" not in os.environ
        assert configure_cublaslt_workspace(CUDA, _perf("none"), recipe) == "none"  # asked for, it holds
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert configure_cublaslt_workspace(CUDA, _perf("auto"), "fp8_tensorwise") == "none"


def test_the_catalog_refuses_a_workspace_it_does_not_know():
    entry = dataclasses.replace(catalog.get("bf16"), name="bf16_other", cublaslt_workspace="auto")
    with pytest.raises(ValueError, match="cublaslt_workspace of 'bf16_other' must be one of default, none"):
        catalog.add_recipe(entry)
    assert "bf16_other" not in catalog.recipe_names()


def test_a_cpu_run_changes_nothing():
    import os
    assert configure_cublaslt_workspace(CPU, _perf("none")) == "default"
    assert "CUBLASLT_WORKSPACE_SIZE" not in os.environ


def test_the_spec_takes_the_three_values_and_says_what_else_is_wrong():
    base = {"recipe": "fp8_delayed", "model": "tiny", "data": {"corpus": "random", "vocab_size": 512, "seq_len": 64},
            "training": {"steps": 1, "warmup_steps": 0, "batch_size": 2}}
    for value in ("auto", "default", "none"):
        spec = RunSpec.from_dict({**base, "training": {**base["training"], "perf": {"cublaslt_workspace": value}}})
        assert spec.training.perf.cublaslt_workspace == value
    assert RunSpec.from_dict(base).training.perf.cublaslt_workspace == "auto"
    with pytest.raises(SpecError, match="cublaslt_workspace.*auto.*default.*none"):
        RunSpec.from_dict({**base, "training": {**base["training"], "perf": {"cublaslt_workspace": "0"}}})
