"""Tiny random configs of the architectures the lab must train (no download): every linear dim a multiple of
32, so the FP8/MX/NVFP4 blocks tile them, 2 blocks, a vocabulary that holds the tests' 512-token BPE."""
from __future__ import annotations

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _llama_like(**extra):
    return dict(COMMON, intermediate_size=128, num_key_value_heads=2, **extra)


# model_type -> (transformers config class name, its kwargs)
ARCHITECTURES = {
    "llama": ("LlamaConfig", _llama_like()),
    "mistral": ("MistralConfig", _llama_like(sliding_window=8)),
    "qwen2": ("Qwen2Config", _llama_like(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", _llama_like(head_dim=16)),
    "gemma2": ("Gemma2Config", _llama_like(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                           tie_word_embeddings=True)),
    "phi3": ("Phi3Config", _llama_like()),
    "olmo2": ("Olmo2Config", _llama_like()),
    "gpt_neox": ("GPTNeoXConfig", dict(COMMON, intermediate_size=128, rotary_pct=0.5)),
    "qwen2_moe": ("Qwen2MoeConfig", _llama_like(moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                                num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                                                mlp_only_layers=[0])),
}


# Also counted (FLOPs, GEMM shapes, conversion report) but not trained in every recipe, to keep the suite short.
MORE_ARCHITECTURES = {
    "gemma3_text": ("Gemma3TextConfig", _llama_like(head_dim=16, query_pre_attn_scalar=16, sliding_window=8)),
    "mixtral": ("MixtralConfig", _llama_like(num_local_experts=4, num_experts_per_tok=2)),
}


def tiny_config(arch: str, **overrides):
    import transformers
    name, kwargs = {**ARCHITECTURES, **MORE_ARCHITECTURES}[arch]
    return getattr(transformers, name)(**{**kwargs, **overrides})


def write_config(arch: str, folder) -> str:
    """`arch`'s tiny config.json in `folder`; returns the folder."""
    tiny_config(arch).save_pretrained(folder)
    return str(folder)
