"""The small GPU training run the CUDA-graph tests compare with and without graphs (a recipe's `cuda_graphs`
default against `compile_mode: default`): 4 Llama blocks, gradient accumulation 2, validation every 4 steps,
deterministic SDPA, so two runs that compute the same thing give the same losses to ~1e-3."""
import pytest

from training.sink import ListSink
from training.train import train


def tiny_run(recipe: str, perf: dict, recipe_options: dict | None = None):
    spec = {"model": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                      "num_attention_heads": 8, "num_key_value_heads": 4},
            "data": {"corpus": "random", "vocab_size": 4096, "seq_len": 256},
            "training": {"steps": 12, "batch_size": 8, "grad_accum": 2, "lr": 1e-3, "warmup_steps": 2,
                         "val_every": 4, "val_batches": 2, "device": "cuda", "compile": True,
                         "param_dtype": "bf16", "perf": {"sdpa_backend": "math", **perf}},  # deterministic SDPA
            "seed": 0, "recipe": recipe, "recipe_options": recipe_options or {}}
    sink = ListSink()
    result = train(spec, sink)
    assert result.status == "succeeded", result
    return [v for _, v in sink.series("train/loss")], dict(sink.series("val/loss")), result.summary


def assert_graphs_by_default_train_like_without(recipe: str, recipe_options: dict | None = None) -> None:
    # One process: the update runs after the backward by default (overlap_optimizer auto), and the graphs replay
    # either way; the overlapped update (its per-layer waits before each graph) is checked too.
    graphs, graphs_val, summary = tiny_run(recipe, {}, recipe_options)
    assert summary.get("compile_mode") == "reduce-overhead" and summary.get("overlap_optimizer") is False
    overlapped, overlapped_val, summary_over = tiny_run(recipe, {"overlap_optimizer": True}, recipe_options)
    assert summary_over.get("compile_mode") == "reduce-overhead" and summary_over.get("overlap_optimizer") is True
    plain, plain_val, summary_plain = tiny_run(recipe, {"compile_mode": "default"}, recipe_options)
    assert summary_plain.get("compile_mode") == "default"
    assert len(graphs) == len(plain) == 12 and sorted(graphs_val) == sorted(plain_val) == [4, 8, 12]
    for run, run_val in ((graphs, graphs_val), (overlapped, overlapped_val)):
        for a, b in zip(run, plain):
            assert a == pytest.approx(b, rel=1e-3)
        for step in plain_val:
            assert run_val[step] == pytest.approx(plain_val[step], rel=1e-3)
