"""Two or more GPUs only (skipped elsewhere): FSDP2 over NCCL on N GPUs of one host (4 where the machine has them,
else 2), on the real FP8 kernels (torchao's tensorwise linears with FP8 all-gather of the weights, fp8_delayed with
its amaxes max-reduced across ranks, rowwise, blockwise) and the emulated MXFP8/NVFP4, against the same recipe on
one GPU and against DDP on as many GPUs; fp8_delayed's scales identical on every rank at every step; a sharded
checkpoint written by N processes resumed on 2 (DCP resharding) continues the curve.

The CPU tests (test_fsdp.py) check the same on 2 and 4 gloo processes with the emulated formats only;
test_fsdp_recipes_gpu.py checks FSDP2 on one GPU. Set PLAB_GPU_TEST_REPORT=FILE to have the figures written as JSON.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.training.test_fsdp import _job, _launch, _losses, _result
from training.sink import ListSink
from training.train import train

NGPU = min(4, torch.cuda.device_count()) if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(NGPU < 2 or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs two or more SM90+ GPUs (NCCL, FP8 tensor cores)")

RECIPES = ("bf16", "fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4")
STEPS = 8
EXPECTED_BACKEND = {"bf16": "bf16", "fp8_tensorwise": "real", "fp8_delayed": "real", "fp8_rowwise": "real",
                    "fp8_blockwise": "real", "mxfp8": "emulated", "nvfp4": "emulated"}
# FSDP2 on N GPUs against one GPU, |loss difference| at any of the 8 steps. Each rank scales its own activations
# and gradients (X and dY amaxes per rank, as the CPU test's gloo processes do), NVFP4 rounds gradients
# stochastically from per-rank generators, and the gradients are reduced in FP32 where one GPU keeps them in BF16.
# Measured on 4 x H200 (gpu_tests_2026-11-26T2254_*): bf16 2.9e-4, fp8_tensorwise 1.8e-3, fp8_delayed 4.1e-3,
# fp8_rowwise 1.3e-3, fp8_blockwise 2.0e-3, mxfp8 1.2e-3, nvfp4 7.0e-3; the checkpoints resumed on 2 GPUs 1.2e-4
# (bf16) and 5.7e-4 (fp8_delayed) from the uninterrupted run. The tolerances leave about 3x of that.
TOLERANCE = {"bf16": 1e-3, "fp8_tensorwise": 6e-3, "fp8_delayed": 1.2e-2, "fp8_rowwise": 4e-3, "fp8_blockwise": 6e-3,
             "mxfp8": 4e-3, "nvfp4": 2e-2}
RESUMED = ("bf16", "fp8_delayed")


def _spec(recipe: str, parallel: str, gpus: int, **training) -> dict:
    # Every dim a multiple of 128 (fp8_blockwise's tiles); 8 x 256 tokens per step (2 sequences per rank on 4 GPUs);
    # math SDPA (deterministic).
    return {"model": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                      "num_attention_heads": 8, "num_key_value_heads": 4},
            "data": {"corpus": "random", "vocab_size": 4096, "seq_len": 256},
            "training": {"steps": STEPS, "batch_size": 8, "lr": 1e-3, "warmup_steps": 2, "val_every": 0,
                         "device": "cuda", "compile": False, "param_dtype": "bf16", "parallel": parallel,
                         "gpus": gpus, "perf": {"sdpa_backend": "math"}, **training},
            "seed": 0, "recipe": recipe}


def test_fsdp2_on_several_gpus_trains_every_recipe_like_one_gpu_and_reshards_its_checkpoints(tmp_path):
    import torch.distributed as dist

    n = NGPU
    report: dict = {"gpus": n, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "steps": STEPS, "rows": []}
    single = {}
    for r in RECIPES:
        sink = ListSink()
        try:
            res = train(_spec(r, "ddp", 1), sink)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        assert res.status == "succeeded" and res.gemm_backend == EXPECTED_BACKEND[r], (r, res.status,
                                                                                      res.gemm_backend)
        single[r] = dict(sink.series("train/loss"))

    def ckpt(r):
        return STEPS // 2 if r in RESUMED else 0

    cache = tmp_path / "cache"
    _launch(n, [_job(_spec(r, p, n, checkpoint_every=ckpt(r) if p == "fsdp" else 0), tmp_path, f"{p}{n}_{r}", cache)
                for p in ("fsdp", "ddp") for r in RECIPES], tmp_path, "many")

    failures = []
    for r in RECIPES:
        fsdp, ddp = _losses(tmp_path, f"fsdp{n}_{r}"), _losses(tmp_path, f"ddp{n}_{r}")
        summary = _result(tmp_path, f"fsdp{n}_{r}")["summary"]
        diffs = [abs(fsdp[s] - single[r][s]) for s in range(1, STEPS + 1)]
        row = {"recipe": r, "gemm_backend": _result(tmp_path, f"fsdp{n}_{r}")["gemm_backend"],
               "first_loss_one_gpu": single[r][1], "first_loss_ddp": ddp[1], "first_loss_fsdp": fsdp[1],
               "max_abs_diff_vs_one_gpu": max(diffs), "max_abs_diff_fsdp_vs_ddp": max(
                   abs(fsdp[s] - ddp[s]) for s in range(1, STEPS + 1)), "tolerance": TOLERANCE[r]}
        report["rows"].append(row)
        print(json.dumps(row))
        assert sorted(fsdp) == sorted(ddp) == list(range(1, STEPS + 1)), r
        assert summary["parallel"] == "fsdp" and summary["world_size"] == n, summary
        assert row["gemm_backend"] == EXPECTED_BACKEND[r], row
        # The first step against DDP on as many GPUs: the same batch split, the same per-rank activations; a recipe
        # that quantized a weight shard instead of the gathered weight (another amax, another block grid) would
        # differ here. fp8_tensorwise's FP8 all-gather casts the FP32 shard where DDP casts its BF16 copy (4 x H200:
        # 8.414936 against 8.415274; every other recipe identical).
        if fsdp[1] != pytest.approx(ddp[1], rel=1e-4):
            failures.append(f"{r}: first step FSDP2 {fsdp[1]} against DDP {ddp[1]}")
        if max(diffs) > TOLERANCE[r]:
            failures.append(f"{r}: {max(diffs):.2e} from one GPU, tolerance {TOLERANCE[r]}")

    # fp8_delayed: every rank casts with the same scales at every step (amaxes max-reduced across ranks).
    per_rank = [torch.load(tmp_path / f"fsdp{n}_fp8_delayed.jsonl.scales_rank{k}.pt", map_location="cpu")
                for k in range(n)]
    report["delayed_scales"] = {"shape": list(per_rank[0].shape),
                                "ranks_identical": all(torch.equal(t, per_rank[0]) for t in per_rank)}
    assert per_rank[0].shape[0] == STEPS and torch.all(per_rank[0] > 0)
    assert report["delayed_scales"]["ranks_identical"], "fp8_delayed scales differ between ranks"
    assert (tmp_path / f"fsdp{n}_bf16/checkpoints/step_{STEPS:08d}/dcp/.metadata").exists()
    assert (tmp_path / f"fsdp{n}_bf16/checkpoints/step_{STEPS:08d}/model.safetensors").exists()

    # Resume from the middle on 2 GPUs: DCP reshards the N-process checkpoint (on a 2-GPU machine, the same number of
    # processes), and the run continues the same curve.
    jobs = []
    for r in RESUMED:
        name = f"fsdp{n}_{r}"
        shutil.rmtree(tmp_path / name / "checkpoints" / f"step_{STEPS:08d}")
        job = _job(_spec(r, "fsdp", 2, checkpoint_every=STEPS // 2), tmp_path, name, cache)
        job["metrics"] = job["metrics"].replace(".jsonl", ".resumed.jsonl")
        jobs.append(job)
    _launch(2, jobs, tmp_path, "resume")
    report["resumed_on_2"] = {}
    for r in RESUMED:
        first, again = _losses(tmp_path, f"fsdp{n}_{r}"), _losses(tmp_path, f"fsdp{n}_{r}.resumed")
        assert sorted(again) == list(range(STEPS // 2 + 1, STEPS + 1)), (r, sorted(again))
        gap = max(abs(again[s] - first[s]) for s in again)
        report["resumed_on_2"][r] = {"max_abs_diff": gap, "losses": again, "uninterrupted": {
            s: first[s] for s in again}}
        print(f"{r}: resumed on 2 from {n} processes, max |diff| {gap:.2e}")
        if gap > TOLERANCE[r]:
            failures.append(f"{r}: resumed on 2 GPUs {gap:.2e} from the uninterrupted run")

    if os.environ.get("PLAB_GPU_TEST_REPORT"):
        Path(os.environ["PLAB_GPU_TEST_REPORT"]).write_text(json.dumps(report, indent=1))
    assert not failures, failures
