"""gemm_shapes: the GEMMs of one training step, hand-computed for GQA, MHA, custom head_dim and plain MLP."""
import pytest
from transformers import LlamaConfig

from training.gemm import GemmShape, gemm_shapes, parse_shapes


def as_table(shapes):
    return {(s.layer, s.gemm): (s.m, s.k, s.n, s.count) for s in shapes}


def test_gqa_llama_1b_shapes_match_hand_computation():
    # 1.14B anchor: T = 4·2048 = 8192, head_dim = 2048/16 = 128, QKV = (16 + 2·8)·128 = 4096.
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=8, vocab_size=32000)
    assert as_table(gemm_shapes(cfg, 4, 2048)) == {
        ("qkv", "fprop"): (8192, 2048, 4096, 16),
        ("qkv", "dgrad"): (8192, 4096, 2048, 16),
        ("qkv", "wgrad"): (4096, 8192, 2048, 16),
        ("attn_out", "fprop"): (8192, 2048, 2048, 16),
        ("attn_out", "dgrad"): (8192, 2048, 2048, 16),
        ("attn_out", "wgrad"): (2048, 8192, 2048, 16),
        ("mlp_up", "fprop"): (8192, 2048, 16384, 16),    # gate and up fused: 2·8192
        ("mlp_up", "dgrad"): (8192, 16384, 2048, 16),
        ("mlp_up", "wgrad"): (16384, 8192, 2048, 16),
        ("mlp_down", "fprop"): (8192, 8192, 2048, 16),
        ("mlp_down", "dgrad"): (8192, 2048, 8192, 16),
        ("mlp_down", "wgrad"): (2048, 8192, 8192, 16),
        ("lm_head", "fprop"): (8192, 2048, 32000, 1),
        ("lm_head", "dgrad"): (8192, 32000, 2048, 1),
        ("lm_head", "wgrad"): (32000, 8192, 2048, 1),
    }


def test_mha_dict_without_kv_heads_has_qkv_three_times_hidden():
    dims = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=1000)
    t = as_table(gemm_shapes(dims, 2, 8))  # T = 16, head_dim 64
    assert t[("qkv", "fprop")] == (16, 256, 768, 2)
    assert t[("qkv", "wgrad")] == (768, 16, 256, 2)
    assert t[("attn_out", "fprop")] == (16, 256, 256, 2)
    assert t[("mlp_up", "fprop")] == (16, 256, 1376, 2)
    assert t[("mlp_down", "dgrad")] == (16, 256, 688, 2)
    assert t[("lm_head", "dgrad")] == (16, 1000, 256, 1)


def test_custom_head_dim_sets_qkv_and_attention_output_widths():
    # q width = 8·128 = 1024 ≠ hidden 512; QKV = (8 + 2·2)·128 = 1536.
    dims = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=8,
                num_key_value_heads=2, head_dim=128, vocab_size=512)
    t = as_table(gemm_shapes(dims, 1, 32))
    assert t[("qkv", "fprop")] == (32, 512, 1536, 3)
    assert t[("attn_out", "fprop")] == (32, 1024, 512, 3)
    assert t[("attn_out", "dgrad")] == (32, 512, 1024, 3)
    assert t[("attn_out", "wgrad")] == (512, 32, 1024, 3)


def test_non_gated_mlp_declares_codonfm_up_projection_of_width_intermediate():
    codon = dict(hidden_size=4096, intermediate_size=16384, num_hidden_layers=24, num_attention_heads=32,
                 vocab_size=128)
    t = as_table(gemm_shapes(codon, 31, 512, gated_mlp=False))  # T = 15872, no GQA
    assert t[("qkv", "fprop")] == (15872, 4096, 12288, 24)
    assert t[("mlp_up", "fprop")] == (15872, 4096, 16384, 24)
    assert t[("mlp_up", "wgrad")] == (16384, 15872, 4096, 24)
    assert as_table(gemm_shapes(codon, 31, 512))[("mlp_up", "fprop")] == (15872, 4096, 32768, 24)


def test_step_flops_equal_six_tokens_times_linear_parameters():
    dims = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=2048)
    shapes = gemm_shapes(dims, 8, 128)
    linear_params = 4 * (256 * 512 + 256 * 256 + 256 * 1536 + 768 * 256) + 256 * 2048
    assert sum(s.count * s.flops for s in shapes) == 6 * 8 * 128 * linear_params


@pytest.mark.parametrize("dims, micro_batch, seq_len, message", [
    (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=100), 1, 8,
     "lacks num_attention_heads"),
    (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=3, vocab_size=100), 1, 8, "multiple of num_key_value_heads"),
    (dict(hidden_size=250, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
          vocab_size=100), 1, 8, "give head_dim explicitly"),
    (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
          vocab_size=100, num_kv_heads=2), 1, 8, "unknown model config keys"),
    (dict(hidden_size=256, intermediate_size=-1, num_hidden_layers=2, num_attention_heads=4,
          vocab_size=100), 1, 8, "intermediate_size must be a positive integer"),
    (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
          vocab_size=100), 0, 8, "micro_batch must be a positive integer"),
    ("1b", 1, 8, "config must be a transformers LlamaConfig or a dict"),
])
def test_invalid_configs_are_rejected_with_a_message_saying_what_to_fix(dims, micro_batch, seq_len, message):
    with pytest.raises(ValueError, match=message):
        gemm_shapes(dims, micro_batch, seq_len)


def test_explicit_shapes_parse_as_single_fprop_gemms():
    assert parse_shapes("64x128x96, 8192X4096x14336") == [
        GemmShape("custom", "fprop", 64, 128, 96, 1), GemmShape("custom", "fprop", 8192, 4096, 14336, 1)]
    for bad in ("64x128", "64x0x96", "axbxc", ""):
        with pytest.raises(ValueError):
            parse_shapes(bad)
