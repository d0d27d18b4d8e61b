"""GPU only (skipped on CPU): on a GPU a Llama's Q, K and V are fused by default (training.perf.fuse_qkv left out),
except where the run's keep_bf16 rules would keep other layers fused than apart. Before 2026-12-07 a rule naming
q_proj alone matched nothing once fused: the run failed at start on a GPU (and trained on a CPU)."""
import pytest
import torch

from training.config import RunSpec
from training.model import model_config
from training.setup import _model_with_recipe
from training.sink import ListSink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _built(rules):
    spec = RunSpec.from_dict({"model": "tiny", "data": {"corpus": "tinyshakespeare", "vocab_size": 512, "seq_len": 64},
                              "recipe": "fp8_tensorwise", "keep_bf16": rules}, check_paths=False)
    config = model_config(spec.model, spec.vocab_size, spec.data.seq_len)
    model, report, fused_qkv, *_ = _model_with_recipe(spec, config, torch.device("cuda"), "bf16", ListSink())
    kept = {e["name"] for e in report.to_dict()["layers"] if "keep_bf16" in (e.get("reason") or "")}
    return fused_qkv, kept


def test_a_rule_naming_q_proj_keeps_q_k_and_v_apart_and_q_in_bf16():
    fused, kept = _built(["*.q_proj"])
    assert fused is False and kept == {f"layers.{i}.self_attn.q_proj" for i in range(4)}


def test_rules_that_keep_the_same_layers_either_way_leave_the_fusion_on():
    fused, kept = _built(["layers.1.*"])
    assert fused is True and "layers.1.self_attn.qkv_proj" in kept and len(kept) == 5  # qkv, o, gate, up, down
