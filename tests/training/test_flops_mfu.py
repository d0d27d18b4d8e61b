"""FLOPs-per-token formula against hand counts, GPU peak lookup and MFU."""
import pytest

from training.flops import PEAK_TFLOPS, flops_per_token, gpu_model, matmul_params, mfu, peak_tflops
from training.model import llama_config


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
