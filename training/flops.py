"""Model FLOPs per token, peak TFLOP/s per GPU, and MFU.

FLOPs per token (training = forward + backward), the PaLM convention (Chowdhery et al. 2022,
appendix B) that nanoGPT's `estimate_mfu` and torchtitan also use:

    flops_per_token = 6 * N_matmul + 12 * L * T * (n_heads * head_dim)

* `N_matmul`: weights of every linear layer, LM head included (for Llama q, k, v, o, gate, up, down per
  block, plus hidden x vocab for the head), read from the model's own modules, so any architecture counts
  exactly (fused projections, biases' matmuls, an MoE's router and the top-k experts each token goes
  through). Embeddings are excluded (a lookup, no matmul); norms are excluded (no matmul, negligible).
  6 = 2 (multiply-add) x 3 (forward, grad w.r.t. input, grad w.r.t. weight).
* Attention scores and the weighted sum of values: per layer and token, Q·Kᵀ and P·V are each
  2·T·(n_heads·head_dim) FLOPs forward, x3 for training ⇒ 12·T·n_heads·head_dim, T = sequence length.
* **Causal masking is NOT halved**: we count the full T x T score matrix, like PaLM and nanoGPT, so our
  MFU is comparable with published figures. A causal FlashAttention kernel does about half that work,
  so the attention share of MFU is overstated by up to 2x (for the 1b preset at T=2048 that term is
  ~11 % of the total).

MFU is always reported against the GPU's dense **BF16** peak, for every recipe, so a faster FP8 recipe
shows as higher MFU rather than being normalised away; "effective TFLOP/s" is flops_per_token x tokens/s.
"""
from __future__ import annotations

# Dense (no 2:4 sparsity) tensor-core peaks in TFLOP/s, per GPU: (bf16, fp8, fp4); None = no such units.
# NVIDIA data sheets quote "with sparsity" figures; the dense peak is half of those.
PEAK_TFLOPS: dict[str, dict[str, float | None]] = {
    # H100 SXM5 data sheet (nvidia.com/en-us/data-center/h100): BF16 1,979 / FP8 3,958 sparse.
    "H100 SXM": {"bf16": 989.4, "fp8": 1978.9, "fp4": None},
    # Same data sheet, H100 PCIe column: BF16 1,513 / FP8 3,026 sparse.
    "H100 PCIe": {"bf16": 756.5, "fp8": 1513.0, "fp4": None},
    # Same data sheet, H100 NVL column: BF16 1,671 / FP8 3,341 sparse.
    "H100 NVL": {"bf16": 835.5, "fp8": 1670.5, "fp4": None},
    # H200 data sheet (nvidia.com/en-us/data-center/h200): SXM BF16 1,979 / FP8 3,958 sparse (same SM as H100).
    "H200": {"bf16": 989.4, "fp8": 1978.9, "fp4": None},
    # Same data sheet, H200 NVL column (a 600 W PCIe card): BF16 1,671 / FP8 3,341 sparse, as the H100 NVL.
    "H200 NVL": {"bf16": 835.5, "fp8": 1670.5, "fp4": None},
    # HGX B200 data sheet (8 GPUs): FP4 144 PF, FP8 72 PF, BF16 36 PF sparse ⇒ per GPU dense 9 / 4.5 / 2.25 PF.
    "B200": {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0},
    # GB200 NVL72 data sheet (72 GPUs): FP4 1,440 PF, FP8 720 PF, BF16 360 PF sparse ⇒ per GPU dense 10 / 5 / 2.5 PF.
    "GB200": {"bf16": 2500.0, "fp8": 5000.0, "fp4": 10000.0},
    # A100 data sheet: BF16 312 dense (624 sparse); no FP8/FP4 tensor cores.
    "A100": {"bf16": 312.0, "fp8": None, "fp4": None},
    # L40S data sheet: BF16 362.05 / FP8 733 dense (733 / 1,466 with sparsity).
    "L40S": {"bf16": 362.05, "fp8": 733.0, "fp4": None},
    # Ada Lovelace whitepaper (RTX 4090), FP32 accumulate: BF16 165.2 / FP8 330.3 dense.
    "RTX 4090": {"bf16": 165.2, "fp8": 330.3, "fp4": None},
}

# Order matters: the first substring found in the device name wins (GB200 before B200, variants of
# H100 before plain H100).
_NAME_PATTERNS = [
    ("GB200", "GB200"), ("B200", "B200"), ("H200 NVL", "H200 NVL"), ("H200", "H200"),
    ("H100 NVL", "H100 NVL"), ("H100 PCIE", "H100 PCIe"), ("H100", "H100 SXM"),
    ("A100", "A100"), ("L40S", "L40S"), ("RTX 4090", "RTX 4090"),
]


def gpu_model(device_name: str | None) -> str | None:
    """Key of PEAK_TFLOPS for a `torch.cuda.get_device_name()` string, or None if unknown."""
    if not device_name:
        return None
    upper = device_name.upper()
    for pattern, key in _NAME_PATTERNS:
        if pattern in upper:
            return key
    return None


def peak_tflops(device_name: str | None, dtype: str = "bf16") -> float | None:
    if dtype not in ("bf16", "fp8", "fp4"):
        raise ValueError(f"dtype must be 'bf16', 'fp8' or 'fp4', got {dtype!r}")
    key = gpu_model(device_name)
    return PEAK_TFLOPS[key][dtype] if key else None


def _as_model(model_or_config):
    """The model whose modules are counted: a model as given, a config built on the meta device."""
    import torch
    if isinstance(model_or_config, torch.nn.Module):
        return model_or_config
    from training.model import meta_model
    return meta_model(model_or_config)


def matmul_params(model_or_config) -> int:
    """Weights each token is multiplied by, over every linear layer (attention and MLP projections, an MoE's
    router, the top-k experts a token goes through, the LM head), counted on the model's own modules
    (training.model.matmul_layers; a config is built on the meta device); embeddings excluded."""
    from training.model import matmul_layers
    return sum(m.fan_in * m.fan_out * m.rows_per_token * m.count for m in matmul_layers(_as_model(model_or_config)))


def flops_per_token(model_or_config, seq_len: int) -> int:
    """Training FLOPs per token: 6·N_matmul + 12·L·T·(heads·head_dim), causal masking not halved.

    `model_or_config`: a transformers causal LM (counted as built: pass an unconverted one) or its config (any
    architecture; built on the meta device)."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    model = _as_model(model_or_config)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    from training.model import decoder_blocks
    attn = 12 * len(decoder_blocks(model)) * seq_len * config.num_attention_heads * head_dim
    return 6 * matmul_params(model) + attn


def mfu(flops_per_token_: float, tokens_per_s: float, *, device_name: str | None, n_gpus: int = 1) -> float | None:
    """Model FLOPs utilisation in [0, 1] against the dense BF16 peak (whatever the recipe), or None when
    the GPU is not in PEAK_TFLOPS (e.g. CPU). `tokens_per_s` is the total over `n_gpus`."""
    peak = peak_tflops(device_name, "bf16")
    if peak is None:
        return None
    return flops_per_token_ * tokens_per_s / (peak * 1e12 * n_gpus)
