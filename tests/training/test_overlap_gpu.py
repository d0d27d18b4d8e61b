"""GPU only (skipped on CPU): the optimizer step overlapped with the next forward on a side stream must give
the same training as the plain step, and regional compilation the same as no compilation."""
import pytest
import torch

from training.sink import ListSink
from training.train import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def no_process_group_left():
    """train() leaves the process group it makes for FSDP2 on one process to its caller (training.launch.run destroys
    it); here the tests are that caller. One left behind failed a later module's `not dist.is_initialized()`
    (test_recipes.py's DDP test, in one pytest process of every GPU test: bench/results/gpu_tests_2026-11-28T1420_*)."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _spec(perf: dict, compile_: bool) -> dict:
    return {"model": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                      "num_attention_heads": 8, "num_key_value_heads": 4},
            "data": {"corpus": "random", "vocab_size": 4096, "seq_len": 256},
            "training": {"steps": 12, "batch_size": 8, "lr": 1e-3, "warmup_steps": 2, "val_every": 6,
                         "val_batches": 2, "device": "cuda", "compile": compile_, "param_dtype": "bf16",
                         "perf": {"sdpa_backend": "math", **perf}},  # math SDPA: deterministic backward
            "seed": 0, "recipe": "bf16"}


def _losses(perf, compile_=False):
    sink = ListSink()
    result = train(_spec(perf, compile_), sink)
    assert result.status == "succeeded"
    return [v for _, v in sink.series("train/loss")], dict(sink.series("val/loss")), result


def test_overlapped_optimizer_step_trains_exactly_like_the_plain_step(tmp_path):
    plain, plain_val, r0 = _losses({"overlap_optimizer": False, "compile_scope": "layers"})
    overlapped, over_val, r1 = _losses({"overlap_optimizer": True, "compile_scope": "layers"})
    assert r1.summary.get("overlap_optimizer") is True and r0.summary.get("overlap_optimizer") is False
    assert overlapped == plain  # same kernels, same order per parameter: bit-identical
    assert over_val == plain_val


def test_regional_compile_matches_eager_closely():
    eager, _, _ = _losses({"overlap_optimizer": True}, compile_=False)
    compiled, _, _ = _losses({"overlap_optimizer": True}, compile_=True)
    for a, b in zip(eager, compiled):
        assert b == pytest.approx(a, rel=2e-2)


def test_fsdp_update_overlapped_with_the_next_forward_trains_exactly_like_the_plain_step(monkeypatch):
    """FSDP2 on one process (training.parallel fsdp): the per-unit update on a side stream, each unit's
    forward waiting for its own update, and each next unit unsharded ahead on a prefetch stream (one rank),
    gives the losses of the update run between backward and forward with FSDP2's own unshards."""
    from training import parallel

    steppers = []
    init = parallel.OverlappedShardedStep.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        steppers.append(self)

    monkeypatch.setattr(parallel.OverlappedShardedStep, "__init__", recording_init)

    def fsdp(overlap: bool, prefetch: bool = True):
        spec = _spec({"overlap_optimizer": overlap, "fsdp_prefetch": prefetch}, False)
        spec["training"]["parallel"] = "fsdp"
        sink = ListSink()
        result = train(spec, sink)
        assert result.status == "succeeded" and result.summary.get("parallel") == "fsdp"
        assert result.summary.get("overlap_optimizer") is overlap
        return [v for _, v in sink.series("train/loss")], dict(sink.series("val/loss"))

    plain = fsdp(False)
    assert fsdp(True) == plain
    assert fsdp(True, prefetch=False) == plain
    assert len(steppers) == 2
    assert steppers[0].prefetch_stream is not None and steppers[1].prefetch_stream is None
    # The 4 blocks after the root, ahead of a training forward that follows an update (not the first step's, nor
    # the one after a validation, which joins the streams): at most 11 steps x 4, always whole steps.
    n = steppers[0].prefetches
    assert 0 < n <= 11 * 4 and n % 4 == 0, n
    assert steppers[1].prefetches == 0


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_fsdp_prefetch_keeps_the_losses_with_checkpointing_accumulation_and_emulated_recipes(recipe):
    """The one-rank prefetch (on by default) beside full activation checkpointing (the backward recomputes each
    block's forward: no prefetch there) and gradient accumulation (only the first micro-batch's forward follows
    an update): the same losses as without it, for emulated recipes (NVFP4's stochastic rounding draws from the
    global generator, so the order of its draws is pinned too)."""
    def run(prefetch: bool):
        spec = _spec({"overlap_optimizer": True, "fsdp_prefetch": prefetch}, False)
        spec["recipe"] = recipe
        spec["training"].update(parallel="fsdp", activation_checkpointing="full", grad_accum=2, steps=8)
        sink = ListSink()
        result = train(spec, sink)
        assert result.status == "succeeded" and result.summary.get("parallel") == "fsdp"
        return [v for _, v in sink.series("train/loss")], dict(sink.series("val/loss"))

    with_prefetch = run(True)
    assert len(with_prefetch[0]) == 8
    assert with_prefetch == run(False)
