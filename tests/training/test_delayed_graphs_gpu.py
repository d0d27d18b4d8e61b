"""GPU only (SM89+, skipped elsewhere): fp8_delayed's real layers replayed as CUDA graphs (the recipe's
`cuda_graphs` option, on: torch.compile mode reduce-overhead, layers compiled one by one) train like the same run
without graphs: the amax history, fed by
every micro-batch (dY's amax leaves each backward through a token's gradient) and pushed by the post-step hook,
must see the same amaxes, with gradient accumulation and validation between steps."""
import pytest
import torch

from training.sink import ListSink
from training.train import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an SM89+ GPU (FP8 GEMMs)")


def _run(perf: dict):
    spec = {"model": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                      "num_attention_heads": 8, "num_key_value_heads": 4},
            "data": {"corpus": "random", "vocab_size": 4096, "seq_len": 256},
            "training": {"steps": 12, "batch_size": 8, "grad_accum": 2, "lr": 1e-3, "warmup_steps": 2,
                         "val_every": 4, "val_batches": 2, "device": "cuda", "compile": True,
                         "param_dtype": "bf16", "perf": {"sdpa_backend": "math", **perf}},  # deterministic SDPA
            "seed": 0, "recipe": "fp8_delayed", "recipe_options": {"amax_history_len": 4}}
    sink = ListSink()
    result = train(spec, sink)
    assert result.status == "succeeded", result
    return [v for _, v in sink.series("train/loss")], dict(sink.series("val/loss")), result.summary


def test_delayed_scaling_replays_cuda_graphs_by_default_and_trains_like_without_them():
    graphs, graphs_val, summary = _run({})
    assert summary.get("compile_mode") == "reduce-overhead"
    plain, plain_val, summary_plain = _run({"compile_mode": "default"})
    assert summary_plain.get("compile_mode") == "default"
    assert len(graphs) == len(plain) == 12 and sorted(graphs_val) == sorted(plain_val) == [4, 8, 12]
    for a, b in zip(graphs, plain):
        assert a == pytest.approx(b, rel=1e-3)
    for step in plain_val:
        assert graphs_val[step] == pytest.approx(plain_val[step], rel=1e-3)
