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


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise"])
def test_rowwise_and_blockwise_scaled_gemms_train_without_the_workspace_in_a_process_of_their_own(recipe):
    """`auto` never picks "none" for these two (their catalog entries say "default"), but a user may: it must run,
    and train as with the workspace up to the GEMMs' accumulation order. Each run in a fresh process, as the CLI,
    a worker's job and train_bench run one (bench/cublaslt_workspace_probe.py)."""
    from bench.cublaslt_workspace_probe import probe

    runs = {w: probe(recipe, w, timeout_s=300, device="cuda", autotune="quick") for w in ("default", "none")}
    for w, run in runs.items():
        assert run.get("status") == "succeeded", (w, run.get("error"), run.get("log_tail", "")[-1500:])
        assert run["gemm_backend"] == "real" and run["cublaslt_workspace"] == w, run
    print(f"{recipe}: default {runs['default']['losses']}, none {runs['none']['losses']}")
    assert runs["none"]["losses"][0] == pytest.approx(runs["default"]["losses"][0], rel=1e-3)
    assert runs["none"]["losses"] == pytest.approx(runs["default"]["losses"], rel=2e-2)


def test_a_blockwise_run_right_after_a_run_without_the_workspace_in_the_same_process(monkeypatch):
    """fp8_rowwise without the workspace, then fp8_blockwise with it, in one process. On an H200 (torch 2.11) the
    blockwise run failed with CUBLAS_STATUS_INVALID_VALUE at its first GEMM in the 1559 run (bench/results/
    gpu_tests_2026-11-28T1559_*; NOTES_floor 78) and passed in the 2005 run at 59d1e21 (bench/results/
    gpu_tests_2026-11-28T2005_*): intermittent, cause not yet known. That one error is an expected failure (xfail,
    reported as such); any other error, a failed run or a wrong workspace fails the test."""
    from bench.cublaslt_workspace_probe import spec
    from training.sink import ListSink
    from training.train import train

    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    monkeypatch.delenv("_PLAB_CUBLASLT_SET", raising=False)
    monkeypatch.setenv("PLAB_BLOCKWISE_AUTOTUNE", "quick")
    for recipe, workspace in (("fp8_rowwise", "none"), ("fp8_blockwise", "default")):
        try:
            result = train(spec(recipe, workspace), ListSink())
        except RuntimeError as e:
            if recipe == "fp8_blockwise" and "CUBLAS_STATUS_INVALID_VALUE" in str(e):
                pytest.xfail(f"the known intermittent failure (NOTES_floor 78): {str(e)[:200]}")
            raise AssertionError(f"{recipe} with cublaslt_workspace={workspace}: {e}") from e
        assert result.status == "succeeded" and result.summary["cublaslt_workspace"] == workspace, result
