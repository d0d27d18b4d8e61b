"""training.perf.loss_weight_grad: how the fused loss forms the LM head's weight gradient (one GEMM over every
token, or a GEMM per chunk into an FP32 accumulator). The numerics are in test_llama_model.py."""
import pytest

from training.config import PerfOptions, RunSpec, SpecError

BASE = {"recipe": "bf16", "model": "tiny", "data": {"corpus": "random", "vocab_size": 512, "seq_len": 64},
        "training": {"steps": 4, "warmup_steps": 0, "batch_size": 4, "val_every": 0}, "seed": 0}


def _spec(perf: dict) -> dict:
    return {**BASE, "training": {**BASE["training"], "perf": perf}}


def test_the_spec_takes_the_three_values_defaults_to_auto_and_says_what_else_is_wrong():
    from training.model import LOSS_WEIGHT_GRADS
    assert PerfOptions.LOSS_WEIGHT_GRADS == ("auto",) + LOSS_WEIGHT_GRADS
    assert RunSpec.from_dict(BASE).training.perf.loss_weight_grad == "auto"
    for value in PerfOptions.LOSS_WEIGHT_GRADS:
        assert RunSpec.from_dict(_spec({"loss_weight_grad": value})).training.perf.loss_weight_grad == value
    with pytest.raises(SpecError, match=r"training.perf.loss_weight_grad must be one of "
                                        r"\['auto', 'one_gemm', 'per_chunk'\], got 'fp32'"):
        RunSpec.from_dict(_spec({"loss_weight_grad": "fp32"}))


def test_auto_keeps_per_chunk_where_activations_are_checkpointed():
    from training.setup import loss_weight_grad
    for ac, perf, expected in (("none", "auto", "one_gemm"), ("full", "auto", "per_chunk"),
                               ("blocks", "auto", "per_chunk"), ("full", "one_gemm", "one_gemm"),
                               ("none", "per_chunk", "per_chunk")):
        spec = RunSpec.from_dict({**BASE, "training": {**BASE["training"], "activation_checkpointing": ac,
                                                       "perf": {"loss_weight_grad": perf}}})
        assert loss_weight_grad(spec.training) == expected, (ac, perf)


def test_the_api_schema_lists_the_same_choices():
    from backend.spec_schema import training_schema
    assert training_schema()["properties"]["perf"]["properties"]["loss_weight_grad"] == {
        "enum": ["auto", "one_gemm", "per_chunk"]}


def test_both_modes_train_alike_and_the_summary_says_which_held():
    from training.sink import ListSink
    from training.train import train

    runs = {}
    for perf in ({}, {"loss_weight_grad": "per_chunk"}, {"fused_loss": False}):
        sink = ListSink()
        result = train(_spec({**perf, "loss_chunk_tokens": 64}), sink)   # 4 chunks of the 256 tokens
        assert result.status == "succeeded", result
        runs[result.summary["loss_weight_grad"]] = [v for _, v in sink.series("train/loss")]
    assert set(runs) == {None, "one_gemm", "per_chunk"}   # auto: one_gemm; None: the unfused loss
    checkpointed = {**BASE, "training": {**BASE["training"], "activation_checkpointing": "full",
                                         "perf": {"loss_chunk_tokens": 64}}}
    sink = ListSink()
    result = train(checkpointed, sink)
    assert result.status == "succeeded" and result.summary["loss_weight_grad"] == "per_chunk"
    assert [v for _, v in sink.series("train/loss")] == pytest.approx(runs["per_chunk"], rel=1e-5)
    assert len(runs["one_gemm"]) == 4
    for mode in ("one_gemm", "per_chunk"):   # FP32 on the CPU: the three differ in rounding only
        assert runs[mode] == pytest.approx(runs[None], rel=1e-5)
