"""GPU only (skipped on CPU): FSDP2's one-rank direct path (`training.parallel.OneRankDirectStep`, the CPU tests are
test_fsdp_one_rank_direct.py) with its Triton update, which reads the BF16 gradients and writes the BF16
parameters, against FSDP2's own one-rank path."""
import pytest
import torch

from training.sink import ListSink
from training.train import train


def _series(sink: ListSink, key: str) -> list[float]:
    return [v for _, v in sink.series(key)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the Triton update reading BF16 gradients")
@pytest.mark.parametrize("recipe,grad_accum", [("bf16", 1), ("bf16", 2), ("mxfp8", 1)])
def test_on_the_gpu_the_direct_path_gives_fsdp2s_bits(recipe, grad_accum):
    """On CUDA the update is `optim_kernels.adamw_shard_update` reading the BF16 gradients and writing the BF16
    parameters; FSDP2's path with the update after the backward runs torch's fused AdamW (`optimizer.step()`) over
    its FP32 gradients: the same arithmetic, so the same losses to the bit (deterministic math SDPA)."""
    import torch.distributed as dist

    def run(direct: bool):
        spec = {"model": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 3,
                          "num_attention_heads": 4, "num_key_value_heads": 2},
                "data": {"corpus": "random", "vocab_size": 2048, "seq_len": 128},
                "training": {"steps": 6, "batch_size": 8, "grad_accum": grad_accum, "lr": 1e-3, "warmup_steps": 2,
                             "val_every": 3, "val_batches": 1, "device": "cuda", "compile": False,
                             "param_dtype": "bf16", "parallel": "fsdp", "grad_clip": 0.5,
                             "perf": {"sdpa_backend": "math", "overlap_optimizer": False,
                                      "fsdp_one_rank_direct": direct}},
                "seed": 0, "recipe": recipe}
        sink = ListSink()
        try:
            result = train(spec, sink)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        assert result.status == "succeeded" and result.summary["fsdp_one_rank_direct"] is direct
        return _series(sink, "train/loss"), _series(sink, "val/loss"), _series(sink, "train/grad_norm")

    fsdp2, direct = run(False), run(True)
    print(recipe, grad_accum, fsdp2[0][-1], direct[0][-1], fsdp2[2][-1], direct[2][-1])
    assert direct[0] == fsdp2[0] and direct[1] == fsdp2[1]
    assert direct[2] == pytest.approx(fsdp2[2], rel=1e-6)
