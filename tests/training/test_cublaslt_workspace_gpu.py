"""GPU only (skipped elsewhere): a run without cuBLASLt's workspace followed, in the same process, by a run with
torch's default must not hand cuBLASLt the first run's empty workspace. On an H200 (torch 2.11) fp8_rowwise's and
fp8_blockwise's scaled GEMMs failed there with CUBLAS_STATUS_INVALID_VALUE after fp8_tensorwise and fp8_delayed
runs (tests/training/test_fsdp_recipes_gpu.py; bench/results/gpu_tests_2026-11-28T1420_*)."""
import pytest
import torch

from training.config import PerfOptions
from training.setup import configure_cublaslt_workspace

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs an SM90+ GPU (FP8 GEMMs with rowwise scales)")


def _rowwise_mm(m=1024, n=2048, k=512):
    """An FP8 GEMM with one scale per row of A and per column of B, the shape of the failing call."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS wants
    sa = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    sb = torch.rand(1, n, device="cuda", generator=g) + 0.5
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)


def test_a_default_run_after_a_run_without_the_workspace_gets_one(monkeypatch):
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    monkeypatch.delenv("_PLAB_CUBLASLT_SET", raising=False)
    device = torch.device("cuda")
    reference = _rowwise_mm()  # torch's default workspace, on the default stream
    stream = torch.cuda.Stream()  # a (handle, stream) pair first used by a run without the workspace, as a
    # tensorwise run's GEMMs use it
    assert configure_cublaslt_workspace(device, PerfOptions(cublaslt_workspace="none")) == "none"
    with torch.cuda.stream(stream):
        tensorwise = torch._scaled_mm(torch.ones(64, 64, device="cuda").to(torch.float8_e4m3fn),
                                      torch.ones(64, 64, device="cuda").to(torch.float8_e4m3fn).t(),
                                      scale_a=torch.ones((), device="cuda"), scale_b=torch.ones((), device="cuda"),
                                      out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert configure_cublaslt_workspace(device, PerfOptions(cublaslt_workspace="default")) == "default"
    with torch.cuda.stream(stream):
        again = _rowwise_mm()  # CUBLAS_STATUS_INVALID_VALUE here when the empty workspace was handed out again
    torch.cuda.synchronize()
    assert torch.equal(tensorwise.float(), torch.full((64, 64), 64.0, device="cuda"))
    torch.testing.assert_close(again.float(), reference.float(), rtol=1e-2, atol=1e-2)  # the same operands


def _spec(recipe: str, workspace: str) -> dict:
    # every dim a multiple of 128 (fp8_blockwise's tiles); math SDPA (deterministic)
    return {"model": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 2,
                      "num_attention_heads": 8, "num_key_value_heads": 4},
            "data": {"corpus": "random", "vocab_size": 4096, "seq_len": 256},
            "training": {"steps": 4, "batch_size": 8, "lr": 1e-3, "warmup_steps": 1, "val_every": 0,
                         "device": "cuda", "compile": False, "param_dtype": "bf16",
                         "perf": {"sdpa_backend": "math", "cublaslt_workspace": workspace}},
            "seed": 0, "recipe": recipe}


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise"])
def test_rowwise_and_blockwise_scaled_gemms_train_without_the_workspace(recipe, monkeypatch):
    """`auto` never picks "none" for these two (their catalog entries say "default"), but a user may: it must run,
    and train as with the workspace up to the GEMMs' accumulation order."""
    from training.sink import ListSink
    from training.train import train

    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    monkeypatch.delenv("_PLAB_CUBLASLT_SET", raising=False)
    losses = {}
    for workspace in ("default", "none"):
        sink = ListSink()
        try:
            result = train(_spec(recipe, workspace), sink)
        except RuntimeError as e:
            raise AssertionError(f"{recipe} with cublaslt_workspace={workspace} (after {sorted(losses)}): {e}") from e
        assert result.status == "succeeded", (workspace, result)
        assert result.gemm_backend == "real" and result.summary["cublaslt_workspace"] == workspace, result.summary
        losses[workspace] = [v for _, v in sink.series("train/loss")]
    print(f"{recipe}: default {losses['default']}, none {losses['none']}")
    assert losses["none"][0] == pytest.approx(losses["default"][0], rel=1e-3)
    assert losses["none"] == pytest.approx(losses["default"], rel=2e-2)
