"""FSDP2 on one process through `training.parallel.OneRankDirectStep` (`perf.fsdp_one_rank_direct`, on by default):
the units keep their BF16 unsharded parameters and gradients, the update reads the BF16 gradients and writes the
FP32 shard and the BF16 parameter. It must train to the bits of FSDP2's own one-rank path (BF16 compute, FP32
reduce dtype, with and without gradient accumulation and clipping), checkpoint and resume exactly (FSDP2's
state-dict hooks reshard the units, the next forward gathers the shards again), leave the FP8 all-gather recipe
on FSDP2's path, and really not pack the gradients into FP32."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training.sink import ListSink
from training.train import train


@pytest.fixture(autouse=True)
def _no_group_left():
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def _fsdp_spec(make_spec, *, direct: bool, steps: int = 4, **training):
    return make_spec(training={"steps": steps, "parallel": "fsdp", "param_dtype": "bf16",
                               "perf": {"fsdp_one_rank_direct": direct}, **training})


def _series(sink: ListSink, key: str) -> list[float]:
    return [v for _, v in sink.series(key)]


class _GradientPacks(TorchDispatchMode):
    """FSDP2's gradient packs into its reduce-scatter buffer (`fsdp::chunk_cat`, torch's op around
    `aten._chunk_cat`), counted. (On CPU the update itself makes FP32 copies of the BF16 gradients for torch's
    fused AdamW; on the GPU the Triton kernel reads them as they are, checked by tests/training/
    test_optim_kernels_gpu.py.)"""

    def __init__(self):
        super().__init__()
        self.packs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "chunk_cat" in str(func):
            self.packs += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad_accum,clip,extra", [(1, 0.0, {}), (1, 0.05, {}), (2, 0.05, {}),
                                                   (1, 0.05, {"activation_checkpointing": "full", "val_every": 2})])
def test_direct_path_trains_to_the_bits_of_fsdp2s_one_rank_path(make_spec, cache_dir, grad_accum, clip, extra):
    """Also with every block recomputed in the backward (the kept unsharded weights serve the recomputation) and
    validation between steps (the same forward, outside the step)."""
    runs = {}
    for direct in (False, True):
        sink = ListSink()
        result = train(_fsdp_spec(make_spec, direct=direct, grad_accum=grad_accum, grad_clip=clip, **extra), sink,
                       cache_dir=cache_dir)
        runs[direct] = (_series(sink, "train/loss") + _series(sink, "val/loss"), _series(sink, "train/grad_norm"),
                        result.summary)
        import torch.distributed as dist
        dist.destroy_process_group()
    assert runs[True][2]["fsdp_one_rank_direct"] is True and runs[False][2]["fsdp_one_rank_direct"] is False
    assert runs[True][2]["parallel"] == "fsdp" and runs[True][2]["overlap_optimizer"] is False
    assert len(runs[True][0]) == 4 + (2 if extra else 1)  # the run's final validation, and one at step 2
    assert runs[True][0] == runs[False][0], "losses must be bit-identical"
    assert runs[True][1] == runs[False][1], "gradient norms must be bit-identical"


def test_direct_path_leaves_out_the_gradient_pack(make_spec, cache_dir):
    counts = {}
    for direct in (False, True):
        with _GradientPacks() as seen:
            train(_fsdp_spec(make_spec, direct=direct, steps=3), ListSink(), cache_dir=cache_dir)
        counts[direct] = seen.packs
        import torch.distributed as dist
        dist.destroy_process_group()
    # FSDP2's path packs every unit's gradients once per step (the tiny model's blocks and the root, 3 steps)
    assert counts[False] >= 9
    assert counts[True] == 0, counts


def test_direct_path_resumes_exactly_from_its_sharded_checkpoint(make_spec, cache_dir, tmp_path):
    """A checkpoint mid-run reshards the units (FSDP2's state-dict hooks); the run goes on from the FP32 shards and
    a resumed run continues the same loss curve."""
    spec = _fsdp_spec(make_spec, direct=True, steps=8, checkpoint_every=4, grad_clip=0.05)
    reference = ListSink()
    train(spec, reference, output_dir=tmp_path / "uninterrupted", cache_dir=cache_dir)
    import torch.distributed as dist
    dist.destroy_process_group()
    plain = ListSink()
    train(_fsdp_spec(make_spec, direct=True, steps=8, grad_clip=0.05), plain, cache_dir=cache_dir)
    dist.destroy_process_group()
    # saving at step 4 changes nothing in the run that saved
    assert _series(reference, "train/loss") == _series(plain, "train/loss")

    calls = []

    class Crash(Exception):
        pass

    def crash_during_step_6():  # a worker dying mid-run: an exception, not a clean cancel (which checkpoints)
        calls.append(1)
        if len(calls) == 6:
            raise Crash("killed")
        return False
    with pytest.raises(Crash):
        train(spec, ListSink(), should_stop=crash_during_step_6, output_dir=tmp_path / "run", cache_dir=cache_dir)
    dist.destroy_process_group()
    resumed = ListSink()
    result = train(spec, resumed, output_dir=tmp_path / "run", cache_dir=cache_dir)
    assert result.status == "succeeded" and result.summary["fsdp_one_rank_direct"] is True
    assert resumed.events_of("resumed")[0]["step"] == 4
    want = dict(reference.series("train/loss"))
    got = dict(resumed.series("train/loss"))
    assert sorted(got) == [5, 6, 7, 8]
    for step, loss in got.items():
        assert loss == want[step], step


def test_fp8_all_gather_weights_and_an_asked_overlap_keep_fsdp2s_path(make_spec, cache_dir):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from training.parallel import one_rank_direct_applies

    # torchao's FP8 all-gather (fp8_tensorwise's real linears under FSDP2) brings its own weight subclass
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    assert one_rank_direct_applies(model)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    assert not one_rank_direct_applies(model)

    spec = _fsdp_spec(make_spec, direct=True, steps=2)
    spec["training"]["perf"]["overlap_optimizer"] = True
    summary = train(spec, ListSink(), cache_dir=cache_dir).summary
    assert summary["fsdp_one_rank_direct"] is False and summary["parallel"] == "fsdp"


def test_the_spec_option_is_validated(make_spec):
    from training.config import RunSpec, SpecError
    with pytest.raises(SpecError, match="fsdp_one_rank_direct"):
        RunSpec.from_dict(make_spec(training={"perf": {"fsdp_one_rank_direct": "yes"}}))

