"""Model FLOPs per token, peak TFLOP/s per GPU, and MFU.

FLOPs per token (training = forward + backward), the PaLM convention (Chowdhery et al. 2022,
appendix B) that nanoGPT's `estimate_mfu` and torchtitan also use, per decoder layer l:

    flops_per_token = 6 * N_matmul + sum over layers l of 6 * T_l * n_heads * (d_qk + d_v)

which for a plain transformer (every layer full softmax attention, d_qk = d_v = head_dim) is PaLM's
6 * N_matmul + 12 * L * T * (n_heads * head_dim).

* `N_matmul`: weights of every linear layer, LM head included (for Llama q, k, v, o, gate, up, down per
  block, plus hidden x vocab for the head), read from the model's own modules, so any architecture counts
  exactly (fused projections, biases' matmuls, an MoE's router and the top-k experts each token goes
  through, MLA's low-rank projections, a linear-attention layer's projections). Embeddings are excluded
  (a lookup, no matmul); norms are excluded (no matmul, negligible).
  6 = 2 (multiply-add) x 3 (forward, grad w.r.t. input, grad w.r.t. weight).
* Attention scores and the weighted sum of values (`attention_flops_per_layer`): per layer and token,
  Q·Kᵀ is 2·T_l·n_heads·d_qk and P·V 2·T_l·n_heads·d_v FLOPs forward, x3 for training ⇒
  6·T_l·n_heads·(d_qk + d_v). d_qk = d_v = head_dim except in multi-head latent attention (DeepSeek-V2/V3:
  d_qk = qk_nope_head_dim + qk_rope_head_dim, d_v = v_head_dim; their config's head_dim is only the RoPE
  part). T_l = keys each query is scored against: T (the sequence length) in a full-attention layer,
  min(T, sliding_window) in a sliding-window layer (Mistral, Phi-3 and Mixtral with sliding_window set slide
  in every layer; Gemma 2/3, GPT-OSS, Qwen2 and others say which layers do in config.layer_types), and
  min(T, attention_chunk_size) in a chunked-attention layer (Llama 4). Layers without softmax attention
  (config.layer_types "linear_attention" - Qwen3-Next's Gated DeltaNet, Mamba -, "conv", "mlp", "moe")
  have no T x T term: they add 0 here, their projections being in N_matmul (their recurrent or
  convolutional state updates are not counted). A layer type not listed here counts as full attention.
* **Causal masking is NOT halved**: we count the full T x T score matrix (the full T x window band of a
  sliding layer), like PaLM and nanoGPT, so our MFU is comparable with published figures. A causal
  FlashAttention kernel does about half that work, so the attention share of MFU is overstated by up to
  2x (for the 1b preset at T=2048 that term is ~11 % of the total). Megatron-LM's count halves it: our
  figures are ~6 % above a Megatron-style count for the 1b preset at 2048, ~13 % for 8B at 8192.
* **Recomputation is not counted**: activation checkpointing re-runs a block's forward, but flops_per_token
  counts the model's work once, so this is model FLOPs utilisation (PaLM's MFU), not hardware FLOPs
  utilisation: with full checkpointing the GPU does ~4/3 of these FLOPs.

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


# config.layer_types strings (transformers 5: configuration_utils.ALLOWED_ATTN_LAYER_TYPES, plus the legacy
# names it remaps). "full_attention" (legacy "attention"; "hybrid" = attention beside a Mamba mixer) and any
# type not listed below score every key. Softmax attention over a window of keys (type -> config attribute):
_WINDOWED_ATTENTION = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}
# No T x T scores: recurrent / linear attention (Mamba, Gated DeltaNet, lightning), convolution, MLP-only layers.
_NO_SCORES = frozenset({"linear_attention", "mamba", "conv", "mlp", "moe"})


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _qk_v_head_dims(config) -> tuple[int, int]:
    """(d_qk, d_v): the head dims Q·Kᵀ and P·V contract over. Multi-head latent attention (DeepSeek-V2/V3 and
    kin) has qk_head_dim = qk_nope_head_dim + qk_rope_head_dim and v_head_dim, and sets head_dim to the RoPE
    part only; everything else uses head_dim (or hidden_size / num_attention_heads) for both."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    d_qk = getattr(config, "qk_head_dim", None)
    if not d_qk:
        nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
        d_qk = nope + rope if isinstance(nope, int) and isinstance(rope, int) else head_dim
    d_v = getattr(config, "v_head_dim", None) or head_dim
    return int(d_qk), int(d_v)


def _config_and_layers(model_or_config):
    """(config, number of decoder layers): a model's config and its blocks (training.model.decoder_blocks, whose
    i-th block is the one config.layer_types[i] describes), or a config and its num_hidden_layers, not built."""
    import torch
    if isinstance(model_or_config, torch.nn.Module):
        from training.model import decoder_blocks
        return model_or_config.config, len(decoder_blocks(model_or_config))
    config = _text_config(model_or_config)
    return config, config.num_hidden_layers


def attention_layer_keys(model_or_config, seq_len: int) -> list[int]:
    """Per decoder layer, in the order of training.model.decoder_blocks (= config.layer_types' order), the
    keys T_l each query is scored against under our convention (causal mask not halved): seq_len for full
    attention, min(seq_len, window) for a sliding or chunked layer, 0 for a layer without softmax attention.
    A model is read as built (its blocks are counted); a config is read alone (num_hidden_layers blocks)."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    config, n_layers = _config_and_layers(model_or_config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # no per-layer types: a sliding_window set (Mistral, Phi-3, Mixtral) slides everywhere
        layer_types = ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"] * n_layers
    layer_types = list(layer_types)
    if len(layer_types) != n_layers:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {n_layers} decoder layers")
    keys = []
    for layer_type in layer_types:
        if layer_type in _NO_SCORES:
            keys.append(0)
        elif layer_type in _WINDOWED_ATTENTION:
            window = getattr(config, _WINDOWED_ATTENTION[layer_type], None)
            keys.append(min(seq_len, int(window)) if window else seq_len)  # no window set: the model attends fully
        else:  # full attention, or a type not listed above (e.g. an indexer's sparse attention): all T keys
            keys.append(seq_len)
    return keys


def attention_flops_per_layer(model_or_config, seq_len: int) -> list[int]:
    """Training FLOPs per token of each decoder layer's Q·Kᵀ and P·V (not its projections, which are in
    matmul_params): 6·T_l·n_heads·(d_qk + d_v), T_l from `attention_layer_keys`, causal masking not halved."""
    config, _ = _config_and_layers(model_or_config)
    d_qk, d_v = _qk_v_head_dims(config)
    return [6 * t * config.num_attention_heads * (d_qk + d_v) for t in attention_layer_keys(model_or_config, seq_len)]


def attention_flops_per_token(model_or_config, seq_len: int) -> int:
    """Training FLOPs per token of attention's score and value matmuls, summed over the decoder layers
    (`attention_flops_per_layer`); `model_or_config` as for `flops_per_token` (a config is not built)."""
    return sum(attention_flops_per_layer(model_or_config, seq_len))


def flops_per_token(model_or_config, seq_len: int) -> int:
    """Training FLOPs per token: 6·N_matmul + Σ_layers 6·T_l·heads·(d_qk + d_v), causal masking not halved
    (= 6·N_matmul + 12·L·T·heads·head_dim for full attention in every layer); see the module docstring.

    `model_or_config`: a transformers causal LM (counted as built: pass an unconverted one) or its config (any
    architecture; built on the meta device)."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    model = _as_model(model_or_config)
    return 6 * matmul_params(model) + attention_flops_per_token(model, seq_len)


def mfu(flops_per_token_: float, tokens_per_s: float, *, device_name: str | None, n_gpus: int = 1) -> float | None:
    """Model FLOPs utilisation in [0, 1] against the dense BF16 peak (whatever the recipe), or None when
    the GPU is not in PEAK_TFLOPS (e.g. CPU). `tokens_per_s` is the total over `n_gpus`."""
    peak = peak_tflops(device_name, "bf16")
    if peak is None:
        return None
    return flops_per_token_ * tokens_per_s / (peak * 1e12 * n_gpus)
