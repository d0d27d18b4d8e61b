"""FSDP2 on CPU (gloo processes): every recipe trains as under DDP, sharded checkpoints resume exactly on the
same number of processes and reshard onto another, the Hugging Face export is the model, activation
checkpointing leaves the numbers alone."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.parallel import checkpointed_blocks, resolve_parallel
from training.sink import ListSink
from training.train import train

REPO = Path(__file__).resolve().parents[2]
RECIPES = ("bf16", "fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4")
DDP_CHECKED = ("bf16", "fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "fp8_blockwise", "nvfp4")


def _launch(nproc: int, jobs: list[dict], tmp: Path, name: str) -> None:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(jobs))
    env = dict(os.environ, PLAB_HOME=str(tmp / "home"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(REPO / "tests" / "training" / "multi_run.py"), str(path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _job(spec: dict, tmp: Path, name: str, cache_dir) -> dict:
    return {"spec": spec, "output_dir": str(tmp / name), "metrics": str(tmp / f"{name}.jsonl"),
            "result": str(tmp / f"{name}.result.json"), "cache_dir": str(cache_dir)}


def _losses(tmp: Path, name: str) -> dict[int, float]:
    lines = [json.loads(x) for x in (tmp / f"{name}.jsonl").read_text().splitlines()]
    return {x["step"]: x["metrics"]["train/loss"] for x in lines
            if x["type"] == "metrics" and "train/loss" in x["metrics"]}


def _result(tmp: Path, name: str) -> dict:
    return json.loads((tmp / f"{name}.result.json").read_text())


# Quantized recipes on N processes vs one: each rank's activations and gradients have their own amax (X and
# dY scaled per micro-batch, as on N GPUs), and NVFP4 rounds gradients stochastically from per-rank generators;
# after 4 steps of tiny-model training that moved the loss by at most (2 / 4 processes, this machine):
# fp8_tensorwise 7.2e-3 / 4.0e-3, fp8_delayed 2.8e-3 / 2.8e-3, fp8_rowwise 9e-5 / 5.7e-4, fp8_blockwise 1.7e-3 /
# 1.4e-3 (its Wgrad blocks of 128 run over each rank's own tokens), mxfp8 1e-6 / 1.9e-4, nvfp4 1.43e-2 / 1.22e-2
# (bf16, FP32 compute: 4.8e-7 / 9.5e-7). The tolerances leave about 2x of that.
# Largest drift from one process over the 4 steps (2 / 4 processes), measured on a CPU with AMX-BF16 (2026-12-07):
# bf16 1e-6 / 5e-7, fp8_tensorwise 5.8e-3 / 7.0e-3, fp8_delayed 7.0e-3 / 8.4e-3, fp8_rowwise 5e-7 / 1.6e-5,
# fp8_blockwise 1.7e-3 / 1.0e-3, mxfp8 3.4e-4 / 2.9e-4, nvfp4 1.3e-2 / 4.1e-3. The gradients' reduction order differs
# with the process count and moves codes across FP8 rounding boundaries; how far depends on the CPU's BF16 matmul
# kernels (fp8_delayed's earlier 6e-3 held on the machines before this one).
TOLERANCE = {"bf16": 1e-5, "fp8_tensorwise": 1.5e-2, "fp8_delayed": 1.5e-2, "fp8_rowwise": 1.5e-3,
             "fp8_blockwise": 4e-3, "mxfp8": 5e-4, "nvfp4": 3e-2}


@pytest.mark.slow
def test_fsdp_on_2_and_4_processes_trains_every_recipe_and_resumes_exactly_or_resharded(make_spec, cache_dir,
                                                                                       tmp_path):
    def spec(recipe, parallel, gpus, **training):
        return make_spec(recipe=recipe, training={"steps": 4, "batch_size": 12, "gpus": gpus, "parallel": parallel,
                                                  **training})

    def ckpt(r):
        return 2 if r in ("bf16", "fp8_delayed") else 0

    single = {}
    for r in RECIPES:
        sink = ListSink()
        train(spec(r, "ddp", 1), sink, cache_dir=cache_dir)
        single[r] = dict(sink.series("train/loss"))
    # DDP on as many processes, for the exact first-step check, with one recipe of each kind of scaling (per
    # tensor, delayed, per row, per 1x128 run and 128x128 tile, per block of 16 elements).
    # And bf16 with every block keeping its gathered weights to the backward (one all-gather per block and step
    # instead of two): the same numbers.
    keep = _job(spec("bf16", "fsdp", 2, perf={"fsdp_reshard_after_forward": "never"}), tmp_path, "keep2_bf16",
                cache_dir)
    _launch(2, [_job(spec(r, p, 2, checkpoint_every=ckpt(r)), tmp_path, f"{p}2_{r}", cache_dir)
                for p in ("fsdp", "ddp") for r in RECIPES if p == "fsdp" or r in DDP_CHECKED] + [keep],
            tmp_path, "two")
    _launch(4, [_job(spec(r, "fsdp", 4, checkpoint_every=ckpt(r)), tmp_path, f"fsdp4_{r}", cache_dir)
                for r in RECIPES], tmp_path, "four")

    for r in RECIPES:
        fsdp2, fsdp4 = (_losses(tmp_path, f"{n}_{r}") for n in ("fsdp2", "fsdp4"))
        assert sorted(fsdp2) == sorted(fsdp4) == [1, 2, 3, 4]
        assert _result(tmp_path, f"fsdp4_{r}")["summary"]["parallel"] == "fsdp"
        assert _result(tmp_path, f"fsdp4_{r}")["summary"]["world_size"] == 4
        # Against DDP on as many processes, the first step is exact: a recipe that quantized a weight shard
        # instead of the gathered weight (another amax, another block grid) would differ here.
        if r in DDP_CHECKED:
            assert fsdp2[1] == pytest.approx(_losses(tmp_path, f"ddp2_{r}")[1], abs=2e-6), r
        tol = TOLERANCE[r]
        for step in (1, 2, 3, 4):
            assert fsdp2[step] == pytest.approx(single[r][step], abs=tol), (r, 2, step)
            assert fsdp4[step] == pytest.approx(single[r][step], abs=tol), (r, 4, step)

    assert _losses(tmp_path, "keep2_bf16") == _losses(tmp_path, "fsdp2_bf16")
    assert _result(tmp_path, "keep2_bf16")["summary"]["fsdp_keeps_gathered_weights"] is True
    assert _result(tmp_path, "fsdp2_bf16")["summary"]["fsdp_keeps_gathered_weights"] is False  # auto, on a CPU

    # fp8_delayed: every rank casts with the same scales at every step (amaxes max-reduced across ranks).
    per_rank = [torch.load(tmp_path / f"fsdp4_fp8_delayed.jsonl.scales_rank{k}.pt") for k in range(4)]
    assert per_rank[0].shape[0] == 4 and torch.all(per_rank[0] > 0)
    for k in (1, 2, 3):
        assert torch.equal(per_rank[k], per_rank[0]), k

    # The Hugging Face export of the sharded checkpoint is the model DDP trained (FP32 masters, same names).
    from safetensors.torch import load_file
    a = load_file(str(tmp_path / "fsdp2_bf16/checkpoints/step_00000004/model.safetensors"))
    b = load_file(str(tmp_path / "ddp2_bf16/checkpoints/step_00000004/model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
    assert (tmp_path / "fsdp2_bf16/checkpoints/step_00000004/dcp/.metadata").exists()

    # Resume from step 2 on 2 processes: of the 2-process runs bit for bit (RNG, optimizer, fp8_delayed's amax
    # histories); of the 4-process runs resharded by DCP, continuing the same curve.
    jobs = []
    for r in ("bf16", "fp8_delayed"):
        for name in (f"fsdp2_{r}", f"fsdp4_{r}"):
            shutil.rmtree(tmp_path / name / "checkpoints" / "step_00000004")
            job = _job(spec(r, "fsdp", 2, checkpoint_every=2), tmp_path, name, cache_dir)
            job["metrics"] = job["metrics"].replace(".jsonl", ".resumed.jsonl")
            jobs.append(job)
    _launch(2, jobs, tmp_path, "resume")
    for r in ("bf16", "fp8_delayed"):
        first, again = _losses(tmp_path, f"fsdp2_{r}"), _losses(tmp_path, f"fsdp2_{r}.resumed")
        assert sorted(again) == [3, 4] and again[3] == first[3] and again[4] == first[4], r
        first, again = _losses(tmp_path, f"fsdp4_{r}"), _losses(tmp_path, f"fsdp4_{r}.resumed")
        assert sorted(again) == [3, 4], r
        for step in (3, 4):
            assert again[step] == pytest.approx(first[step], abs=TOLERANCE[r]), (r, step)


def test_fsdp_on_one_process_is_the_unsharded_run(make_spec, cache_dir):
    """World size 1 with `parallel: fsdp` runs the FSDP2 code path on a one-rank group (to measure its cost);
    the losses are those of the plain run."""
    import torch.distributed as dist

    runs = {}
    try:
        for parallel in ("ddp", "fsdp"):
            sink = ListSink()
            result = train(make_spec(training={"steps": 3, "parallel": parallel}), sink, cache_dir=cache_dir)
            runs[parallel] = (result.summary["parallel"], [v for _, v in sink.series("train/loss")])
            # One process keeps its gathered weights to the backward (nobody to shard across); DDP has none.
            assert result.summary["fsdp_keeps_gathered_weights"] is (True if parallel == "fsdp" else None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert runs["ddp"][0] == "single" and runs["fsdp"][0] == "fsdp"
    assert runs["fsdp"][1] == pytest.approx(runs["ddp"][1], abs=1e-5)


def test_a_checkpoint_of_one_kind_is_refused_by_the_other_with_the_way_out(make_spec, cache_dir, tmp_path):
    from training.config import SpecError
    from training.checkpoint import Checkpointer
    from training.distributed import DistContext
    from training.sink import NullSink

    step = tmp_path / "checkpoints" / "step_00000002"
    (step / "dcp").mkdir(parents=True)
    (step / "training_state.pt").write_bytes(b"")
    ck = Checkpointer(tmp_path, spec=None, ctx=DistContext(), sink=NullSink(), model=None, optimizer=None)
    with pytest.raises(SpecError, match="written by an FSDP run.*training.parallel='fsdp'"):
        ck.resume(None)


def test_auto_shards_only_what_does_not_fit_and_never_one_process():
    cpu = torch.device("cpu")
    assert resolve_parallel("fsdp", 1, 10**9, cpu) == "fsdp"     # asked by name: a one-rank group
    assert resolve_parallel("auto", 1, 10**12, cpu) == "single"
    assert resolve_parallel("auto", 4, 10**12, cpu) == "ddp"     # CPU: no device memory to run out of
    assert resolve_parallel("fsdp", 2, 10, cpu) == "fsdp"
    assert resolve_parallel("ddp", 2, 10**12, cpu) == "ddp"


def test_activation_checkpointing_modes_choose_blocks_and_leave_the_losses_alone(make_spec, cache_dir):
    assert checkpointed_blocks(8, "blocks", 3) == [2, 5]
    assert checkpointed_blocks(4, "none", 1) == []
    assert checkpointed_blocks(4, "ops", 2) == [0, 1, 2, 3]
    base = None
    for mode in ("none", "full", "blocks", "ops"):
        sink = ListSink()
        result = train(make_spec(training={"steps": 3, "activation_checkpointing": mode,
                                           "activation_checkpointing_every": 2}), sink, cache_dir=cache_dir)
        losses = [v for _, v in sink.series("train/loss")]
        ac = result.summary["activation_checkpointing"]
        assert ac["mode"] == mode and ac["blocks"] == {"none": 0, "full": 4, "blocks": 2, "ops": 4}[mode]
        if base is None:
            base = losses
        assert losses == base, mode


def test_activation_checkpointing_really_recomputes(make_spec):
    """The wrapped blocks run their forward again in the backward."""
    from training.config import RunSpec
    from training.model import build_model, llama_config
    from training.parallel import apply_activation_checkpointing

    spec = RunSpec.from_dict(make_spec())
    model = build_model(llama_config(spec.model, 64, 16), 0)
    calls = []
    for layer in model.model.layers:
        def counted(*args, _forward=layer.mlp.forward, **kwargs):
            calls.append(1)
            return _forward(*args, **kwargs)
        layer.mlp.forward = counted
    apply_activation_checkpointing(model, "blocks", 2)
    ids = torch.randint(0, 64, (2, 16))
    model(input_ids=ids).logits.sum().backward()
    assert len(calls) == 4 + 2  # every block once, and blocks 1 and 3 again in the backward


def test_spec_validates_the_new_keys(make_spec):
    from training.config import RunSpec, SpecError
    for bad, match in (({"parallel": "zero3"}, "training.parallel must be one of"),
                       ({"activation_checkpointing": "some"}, "training.activation_checkpointing must be one of"),
                       ({"activation_checkpointing_every": 0}, "activation_checkpointing_every"),
                       ({"perf": {"fsdp_reshard_after_forward": "sometimes"}},
                        r"training.perf.fsdp_reshard_after_forward must be one of \['auto', 'always', 'never'\]")):
        with pytest.raises(SpecError, match=match):
            RunSpec.from_dict(make_spec(training=bad))
    assert RunSpec.from_dict(make_spec(training={"activation_checkpointing": True})).training.activation_checkpointing == "full"
    assert RunSpec.from_dict(make_spec(training={"activation_checkpointing": False})).training.activation_checkpointing == "none"


@pytest.mark.slow
def test_plab_train_starts_the_processes_itself_and_two_train_like_one(make_spec, cache_dir, tmp_path):
    """`plab train FILE` with training.gpus = 2 on a machine without GPUs: two gloo processes (DDP) under torchrun,
    rank 0 alone reporting, training like one process with the same global batch."""
    single = ListSink()
    one = train(make_spec(training={"steps": 6, "batch_size": 8, "val_every": 3}), single, cache_dir=cache_dir)
    spec = make_spec(training={"steps": 6, "batch_size": 8, "val_every": 3, "gpus": 2, "parallel": "ddp"})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PLAB_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "plab.cli", "train", str(tmp_path / "spec.json"),
                           "--output", str(tmp_path / "out"), "--print-every", "1", "--metrics",
                           str(tmp_path / "m.jsonl"), "--result-json", str(tmp_path / "r.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting 2 processes (torchrun)" in proc.stdout
    assert proc.stdout.count("step      6  loss") == 1        # rank 0 alone prints
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    points = [x for x in lines if x["type"] == "metrics"]
    two_loss = {x["step"]: x["metrics"]["train/loss"] for x in points if "train/loss" in x["metrics"]}
    two_val = {x["step"]: x["metrics"]["val/loss"] for x in points if "val/loss" in x["metrics"]}
    assert sorted(two_loss) == list(range(1, 7))      # each step exactly once
    for step, loss in single.series("train/loss"):
        assert two_loss[step] == pytest.approx(loss, abs=2e-5), step
    for step, loss in single.series("val/loss"):
        assert two_val[step] == pytest.approx(loss, abs=2e-5), step
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["status"] == "succeeded" and result["world_size"] == 2 and result["parallel"] == "ddp"
    assert result["checkpoint"].endswith("step_00000006") and one.tokens == 6 * 8 * 32


def test_ddp_resume_restores_each_ranks_own_generators(make_spec, cache_dir, tmp_path):
    """Each rank seeds its own generators and NVFP4's stochastic rounding draws from them; a DDP checkpoint kept
    rank 0's alone and gave it to every rank, so a 2-process nvfp4 run resumed from its step-3 checkpoint moved
    off the straight run's losses (a review: 5.590352 against 5.590508 at step 10)."""
    spec = make_spec(recipe="nvfp4", training={"steps": 5, "batch_size": 8, "gpus": 2, "parallel": "ddp",
                                               "checkpoint_every": 3})
    _launch(2, [_job(spec, tmp_path, "straight", cache_dir)], tmp_path, "straight")
    straight = _losses(tmp_path, "straight")
    shutil.rmtree(tmp_path / "straight" / "checkpoints" / "step_00000005")
    job = _job(spec, tmp_path, "straight", cache_dir)
    job["metrics"] = str(tmp_path / "resumed.jsonl")
    _launch(2, [job], tmp_path, "resume")
    resumed = _losses(tmp_path, "resumed")
    assert sorted(resumed) == [4, 5]
    assert resumed[4] == straight[4] and resumed[5] == straight[5], (resumed, straight)
