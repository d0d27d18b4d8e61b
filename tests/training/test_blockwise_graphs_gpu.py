"""GPU only (SM90+, skipped elsewhere): fp8_blockwise's real kernels replay as CUDA graphs by default (the recipe's
`cuda_graphs` option) and train like the same run without graphs, with gradient accumulation and validation
between steps (validation runs the same compiled layers without grad: other graphs, same pool)."""
import pytest
import torch

from training.sink import ListSink
from training.train import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs an SM90+ GPU (torchao's blockwise FP8 kernels)")


@pytest.fixture(autouse=True, scope="module")
def _autotune_policy():
    from training.precision.fp8_blockwise import apply_autotune_policy
    apply_autotune_policy()


def _run(perf: dict):
    spec = {"model": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                      "num_attention_heads": 8, "num_key_value_heads": 4},
            "data": {"corpus": "random", "vocab_size": 4096, "seq_len": 256},
            "training": {"steps": 12, "batch_size": 8, "grad_accum": 2, "lr": 1e-3, "warmup_steps": 2,
                         "val_every": 4, "val_batches": 2, "device": "cuda", "compile": True,
                         "param_dtype": "bf16", "perf": {"sdpa_backend": "math", **perf}},  # deterministic SDPA
            "seed": 0, "recipe": "fp8_blockwise"}
    sink = ListSink()
    result = train(spec, sink)
    assert result.status == "succeeded", result
    return [v for _, v in sink.series("train/loss")], dict(sink.series("val/loss")), result.summary


def test_blockwise_replays_cuda_graphs_by_default_and_trains_like_without_them():
    graphs, graphs_val, summary = _run({})
    assert summary.get("compile_mode") == "reduce-overhead"
    plain, plain_val, summary_plain = _run({"compile_mode": "default"})
    assert summary_plain.get("compile_mode") == "default"
    assert len(graphs) == len(plain) == 12 and sorted(graphs_val) == sorted(plain_val) == [4, 8, 12]
    for a, b in zip(graphs, plain):
        assert a == pytest.approx(b, rel=1e-3)
    for step in plain_val:
        assert graphs_val[step] == pytest.approx(plain_val[step], rel=1e-3)
