"""FLOPs-per-token formula against hand counts, GPU peak lookup and MFU."""
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from training.flops import (PEAK_TFLOPS, attention_flops_per_layer, attention_flops_per_token, attention_layer_keys,
                            flops_per_token, gpu_model, matmul_params, mfu, peak_tflops)
from training.model import llama_config, meta_model

# Tiny configs built here (no download): hidden 64, 4 query heads of 16 dims, 2 KV heads.
TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def test_flops_per_token_of_the_1b_preset_matches_a_hand_count():
    cfg = llama_config("1b", 32000, 2048)
    # per layer: q 2048·2048 + k,v 2·2048·1024 + o 2048·2048 + gate/up/down 3·2048·8192
    per_layer = 2048 * 2048 + 2 * 2048 * 1024 + 2048 * 2048 + 3 * 2048 * 8192
    assert per_layer == 62_914_560
    n_matmul = 16 * per_layer + 2048 * 32000          # + LM head, embeddings excluded
    assert matmul_params(cfg) == n_matmul == 1_072_168_960
    attention = 12 * 16 * 2048 * (16 * 128)           # full T×T scores, causal not halved
    assert flops_per_token(cfg, 2048) == 6 * n_matmul + attention == 7_238_320_128


def test_flops_per_token_of_a_custom_gqa_model_with_explicit_head_dim():
    cfg = llama_config({"hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 3,
                        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32}, 1000, 64)
    q, kv = 4 * 32, 1 * 32
    per_layer = 96 * q + 2 * 96 * kv + q * 96 + 3 * 96 * 256
    assert per_layer == 12288 + 6144 + 12288 + 73728
    assert flops_per_token(cfg, 64) == 6 * (3 * per_layer + 96 * 1000) + 12 * 3 * 64 * 128


def test_llama_attention_is_12_l_t_heads_head_dim_in_every_layer():
    cfg = llama_config("1b", 32000, 2048)
    assert attention_layer_keys(cfg, 2048) == [2048] * 16
    assert attention_flops_per_layer(cfg, 2048) == [12 * 2048 * 16 * 128] * 16
    assert attention_flops_per_token(cfg, 2048) == 12 * 16 * 2048 * 16 * 128 == 805_306_368
    assert attention_flops_per_token(meta_model(cfg), 2048) == 805_306_368     # a built model, same count
    with pytest.raises(ValueError, match="seq_len"):
        attention_flops_per_token(cfg, 0)


# ------------------------------------------------------------------ multi-head latent attention (DeepSeek-V3)
def _deepseek_v3(**extra):
    return transformers.DeepseekV3Config(**{**TINY, "num_key_value_heads": 4}, num_hidden_layers=3,
                                         moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                         n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                                         q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                         v_head_dim=32, tie_word_embeddings=False, **extra)


def test_mla_scores_over_nope_plus_rope_dims_and_weights_values_over_v_head_dim():
    cfg = _deepseek_v3()
    assert cfg.head_dim == 16   # the RoPE part only: what the old 12·L·T·heads·head_dim used
    # per layer: q_a 64·32, q_b 32·(4 heads·(32+16)), kv_a 64·(32 latent + 16 rope), kv_b 32·(4·(32 nope + 32 v)),
    # o (4·32)·64
    attn_proj = 64 * 32 + 32 * 4 * 48 + 64 * 48 + 32 * 4 * 64 + 4 * 32 * 64
    assert attn_proj == 27_648
    dense_mlp = 3 * 64 * 128                                   # layer 0 (first_k_dense_replace=1)
    moe = 64 * 4 + 2 * (64 * 2 * 32 + 32 * 64) + 3 * 64 * 32   # router, top-2 of gate_up/down, 1 shared expert
    assert moe == 256 + 12_288 + 6_144
    n_matmul = 3 * attn_proj + dense_mlp + 2 * moe + 64 * 512
    assert matmul_params(cfg) == n_matmul == 177_664
    # Q·Kᵀ over d_qk = 32 + 16, P·V over d_v = 32: 6·T·heads·(48 + 32) per layer
    per_layer = 6 * 16 * 4 * (48 + 32)
    assert per_layer == 30_720
    assert attention_flops_per_layer(cfg, 16) == [per_layer] * 3
    assert attention_flops_per_token(cfg, 16) == 92_160 != 12 * 3 * 16 * 4 * 16   # the old count: 36,864
    assert flops_per_token(cfg, 16) == 6 * 177_664 + 92_160 == 1_158_144


def test_mla_flops_equal_the_matmuls_of_one_eager_forward_and_backward():
    from training.model import CausalLMLoss, causal_lm_class
    micro_batch, seq = 2, 16
    cfg = _deepseek_v3()
    cfg._attn_implementation, cfg._experts_implementation = "eager", "eager"  # matmuls the counter sees
    torch.manual_seed(0)
    model = causal_lm_class(cfg)(cfg)
    ids = torch.randint(0, 512, (micro_batch, seq + 1), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        CausalLMLoss(model, fused_loss=False)(ids[:, :-1], ids[:, 1:]).backward()
    assert counter.get_total_flops() == 1_158_144 * micro_batch * seq   # the hand count above


# ------------------------------------------------------------------ sliding-window and chunked layers
def _gemma2(window):
    return transformers.Gemma2Config(**TINY, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16,
                                     sliding_window=window, tie_word_embeddings=True)


def test_gemma2_alternating_sliding_and_full_layers():
    cfg = _gemma2(8)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    full, sliding = 6 * 32 * 4 * (16 + 16), 6 * 8 * 4 * (16 + 16)    # T = 32 keys, or the window of 8
    assert (full, sliding) == (24_576, 6_144)
    assert attention_layer_keys(cfg, 32) == [8, 32, 8, 32]
    assert attention_flops_per_layer(cfg, 32) == [6_144, 24_576, 6_144, 24_576]
    assert attention_flops_per_layer(meta_model(cfg), 32) == [6_144, 24_576, 6_144, 24_576]  # blocks in order
    # q 64·64, k and v 64·32 each, o 64·64, gate/up/down 64·128; the tied LM head is still a 64 x 512 matmul
    n_matmul = 4 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 64 * 512
    assert n_matmul == 180_224
    assert flops_per_token(cfg, 32) == 6 * 180_224 + 2 * 6_144 + 2 * 24_576 == 1_142_784
    # a window wider than the sequence: every layer scores all T keys, PaLM's 12·L·T·heads·head_dim
    wide = _gemma2(64)
    assert attention_layer_keys(wide, 32) == [32] * 4
    assert flops_per_token(wide, 32) == 6 * 180_224 + 12 * 4 * 32 * 4 * 16 == 1_179_648


@pytest.mark.parametrize("cfg, keys", [
    # GPT-OSS: sliding and full layers alternate, window 8
    (lambda: transformers.GptOssConfig(**TINY, num_hidden_layers=4, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=8), [8, 32, 8, 32]),
    # Qwen2 with use_sliding_window: layers from max_window_layers on slide
    (lambda: transformers.Qwen2Config(**TINY, num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
                                      max_window_layers=1), [32, 8, 8, 8]),
    # Qwen2 with a sliding_window but not use_sliding_window: no layer slides
    (lambda: transformers.Qwen2Config(**TINY, num_hidden_layers=4, sliding_window=8), [32, 32, 32, 32]),
    # Phi-3 and Mixtral: no layer_types, a sliding_window slides in every layer
    (lambda: transformers.Phi3Config(**TINY, num_hidden_layers=2, sliding_window=8), [8, 8]),
    (lambda: transformers.MixtralConfig(**TINY, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                        sliding_window=8), [8, 8]),
    (lambda: transformers.MistralConfig(**TINY, num_hidden_layers=2, sliding_window=None), [32, 32]),
    # Llama 4: chunked attention (chunks of 8) in 3 layers of 4, full attention in every 4th
    (lambda: transformers.Llama4TextConfig(**TINY, num_hidden_layers=4, head_dim=16, intermediate_size_mlp=128,
                                           num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=8),
     [8, 8, 8, 32]),
])
def test_windowed_layers_score_min_of_t_and_their_window(cfg, keys):
    cfg = cfg()
    assert attention_layer_keys(cfg, 32) == keys
    # 4 heads of 16 dims, Q·Kᵀ and P·V: 6·T_l·4·(16 + 16) = 768·T_l per layer
    assert attention_flops_per_token(cfg, 32) == 768 * sum(keys)


def test_mistral_slides_in_every_layer():
    cfg = transformers.MistralConfig(**TINY, num_hidden_layers=2, sliding_window=8, tie_word_embeddings=False)
    n_matmul = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 64 * 512
    assert n_matmul == 106_496
    # T = 16 > window 8: each query scores 8 keys; 6·8·4·(16+16) = 6,144 per layer
    assert attention_flops_per_layer(cfg, 16) == [6_144, 6_144]
    assert flops_per_token(cfg, 16) == 6 * 106_496 + 2 * 6_144 == 651_264
    # T = 4 < window: all 4 keys, 6·4·4·32 = 3,072 per layer
    assert flops_per_token(cfg, 4) == 6 * 106_496 + 2 * 3_072 == 645_120


# ------------------------------------------------------------------ hybrids: layers without softmax attention
def test_qwen3_next_linear_attention_layers_have_no_score_term():
    cfg = transformers.Qwen3NextConfig(**TINY, num_hidden_layers=4, head_dim=16, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                       linear_value_head_dim=16, full_attention_interval=2)
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2
    full = 6 * 32 * 4 * (16 + 16)
    assert attention_flops_per_layer(cfg, 32) == [0, full, 0, full] == [0, 24_576, 0, 24_576]
    model = meta_model(cfg)   # builds on the meta device: its blocks line up with layer_types
    assert attention_flops_per_layer(model, 32) == [0, 24_576, 0, 24_576]
    # the Gated DeltaNet's projections are linear modules, in matmul_params; the score term only adds 2 layers'
    assert flops_per_token(cfg, 32) - 6 * matmul_params(cfg) == 49_152 != 12 * 4 * 32 * 4 * 16


def test_layer_types_without_softmax_scores_count_zero_and_unknown_ones_count_full():
    cfg = SimpleNamespace(num_hidden_layers=7, num_attention_heads=2, hidden_size=16, head_dim=8, sliding_window=4,
                          layer_types=["full_attention", "conv", "mlp", "moe", "hybrid", "indexed_attention",
                                       "sliding_attention"])
    assert attention_layer_keys(cfg, 10) == [10, 0, 0, 0, 10, 10, 4]
    assert attention_flops_per_token(cfg, 10) == 6 * (10 + 10 + 10 + 4) * 2 * (8 + 8) == 6_528
    cfg.layer_types = cfg.layer_types[:-1]
    with pytest.raises(ValueError, match="6 entries for 7 decoder layers"):
        attention_layer_keys(cfg, 10)


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA B200", "B200"), ("NVIDIA GB200", "GB200"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L40S", "L40S"), ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("cpu", None), (None, None),
])
def test_device_names_map_to_peak_table_rows(name, key):
    assert gpu_model(name) == key


def test_peak_table_has_dense_bf16_fp8_fp4_for_every_gpu():
    for row in PEAK_TFLOPS.values():
        assert set(row) == {"bf16", "fp8", "fp4"} and row["bf16"] > 0
        if row["fp8"] is not None:
            assert row["fp8"] == pytest.approx(2 * row["bf16"], rel=0.02)
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4


def test_mfu_is_against_the_bf16_peak_summed_over_gpus():
    assert mfu(6e9, 65_000, device_name="NVIDIA H100 80GB HBM3") == pytest.approx(6e9 * 65_000 / 989.4e12)
    assert mfu(6e9, 130_000, device_name="NVIDIA H100 80GB HBM3", n_gpus=2) == pytest.approx(
        mfu(6e9, 65_000, device_name="NVIDIA H100 80GB HBM3"))
    assert mfu(6e9, 65_000, device_name="cpu") is None


def test_gpt_oss_experts_are_read_transposed_and_their_biases_and_a_convolution_are_not_gemms():
    """GPT-OSS stores its experts as (experts, in, out) and computes x @ W[e] (transformers marks them
    is_transposed): gate_up is hidden -> 2 x intermediate, down intermediate -> hidden; its per-expert biases are
    added, not multiplied. Qwen3-Next's depthwise conv1d (a 3-D weight) is not a batched expert GEMM."""
    from training.model import matmul_layers

    cfg = transformers.GptOssConfig(**TINY, num_hidden_layers=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=8)
    layers = {m.role: m for m in matmul_layers(meta_model(cfg))}
    assert (layers["mlp.experts.gate_up_proj"].fan_in, layers["mlp.experts.gate_up_proj"].fan_out) == (64, 256)
    assert (layers["mlp.experts.down_proj"].fan_in, layers["mlp.experts.down_proj"].fan_out) == (128, 64)
    assert not [role for role in layers if "bias" in role]
    # q 64x64, k and v 64x32, o 64x64, router 64x4, top-2 of gate_up 64x256 and down 128x64; LM head 64x512
    assert matmul_params(cfg) == 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 64 * 4 + 2 * (64 * 256 + 128 * 64)) + 64 * 512

    nxt = transformers.Qwen3NextConfig(**TINY, num_hidden_layers=2, head_dim=16, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                       linear_value_head_dim=16, full_attention_interval=2)
    roles = [m.role for m in matmul_layers(meta_model(nxt))]
    assert roles and not [role for role in roles if "conv" in role]


def test_a_mamba_layers_state_matrix_is_not_counted_as_a_gemm_weight():
    """Jamba's and Mamba's A_log is 2-D (d_inner, d_state) and held by the mixer itself, like a router's weight, but
    the selective scan multiplies it element-wise with each token's step size: not a token x weight GEMM. The
    mixer's projections (in, x, dt, out) are."""
    from training.model import matmul_layers

    cfg = transformers.JambaConfig(**TINY, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                   expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                                   mamba_d_state=8, mamba_expand=2, mamba_d_conv=4)
    roles = {m.role: (m.fan_in, m.fan_out) for m in matmul_layers(meta_model(cfg))}
    assert [r for r in roles if r.startswith("mamba.")] == ["mamba.in_proj", "mamba.x_proj", "mamba.dt_proj",
                                                            "mamba.out_proj"]
    assert roles["mamba.in_proj"] == (64, 256) and roles["mamba.out_proj"] == (128, 64)
    mamba = transformers.MambaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, state_size=8)
    assert not [m.role for m in matmul_layers(meta_model(mamba)) if "A_log" in m.role]

