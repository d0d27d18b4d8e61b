"""The GEMMs of one training step: a Llama's derived from its config, any other model's from its modules.

For a linear layer y = x·Wᵀ with `in` inputs, `out` outputs and T = micro_batch·seq_len tokens the three
GEMMs of a training step are (C[m×n] = A[m×k]·B[k×n]):

    fprop  y  = x  · Wᵀ      (m, k, n) = (T,   in,  out)
    dgrad  dx = dy · W       (m, k, n) = (T,   out, in)
    wgrad  dW = dyᵀ · x      (m, k, n) = (out, T,   in)

Unlike the Transformer Engine tool (seed 003), QKV is (heads + 2·kv_heads)·head_dim wide (GQA) and the
gated MLP fuses gate and up into one 2·intermediate-wide GEMM; `gated_mlp=False` declares a plain MLP
(one up-projection of width `intermediate`), as in CodonFM.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping

LAYERS = ("qkv", "attn_out", "mlp_up", "mlp_down", "lm_head")
PASSES = ("fprop", "dgrad", "wgrad")
CUSTOM_LAYER = "custom"

_REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "vocab_size")


@dataclass(frozen=True)
class GemmShape:
    """One GEMM C[m×n] = A[m×k]·B[k×n] that occurs `count` times in one micro-batch step."""

    layer: str
    gemm: str
    m: int
    k: int
    n: int
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def label(self) -> str:
        return f"{self.layer}.{self.gemm} {self.m}x{self.k}x{self.n}"

    def to_dict(self) -> dict:
        return asdict(self)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _field(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def model_dims(config: Any) -> dict:
    """Validated dims of a `LlamaConfig` or a dict with its field names (`head_dim` resolved)."""
    if config is None or isinstance(config, (str, int, float, list, tuple)):
        raise ValueError(
            "config must be a transformers LlamaConfig or a dict with keys "
            f"{', '.join(_REQUIRED_FIELDS)} (optional num_key_value_heads, head_dim); got {config!r}")
    missing = [f for f in _REQUIRED_FIELDS if _field(config, f) is None]
    if missing:
        raise ValueError(f"model config lacks {', '.join(missing)}; a Llama config needs "
                         f"{', '.join(_REQUIRED_FIELDS)} (optional num_key_value_heads, head_dim)")
    if isinstance(config, Mapping):
        known = set(_REQUIRED_FIELDS) | {"num_key_value_heads", "head_dim"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; allowed keys are {sorted(known)}")
    dims = {f: _positive_int(f, _field(config, f)) for f in _REQUIRED_FIELDS}
    heads = dims["num_attention_heads"]
    kv = _field(config, "num_key_value_heads")
    dims["num_key_value_heads"] = heads if kv is None else _positive_int("num_key_value_heads", kv)
    if heads % dims["num_key_value_heads"]:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                         f"({dims['num_key_value_heads']})")
    head_dim = _field(config, "head_dim")
    if head_dim is None:
        if dims["hidden_size"] % heads:
            raise ValueError(f"hidden_size ({dims['hidden_size']}) is not divisible by num_attention_heads "
                             f"({heads}); give head_dim explicitly")
        head_dim = dims["hidden_size"] // heads
    dims["head_dim"] = _positive_int("head_dim", head_dim)
    return dims


def gemm_shapes(config: Any, micro_batch: int, seq_len: int, *, gated_mlp: bool = True) -> list[GemmShape]:
    """All linear-layer GEMMs of one micro-batch training step, per layer and pass, with their counts.

    `config`: a transformers causal LM or the config of any non-Llama architecture: the GEMMs of its real
    modules (`model_gemm_shapes`). A `LlamaConfig` or a dict with `hidden_size`, `intermediate_size`, `num_hidden_layers`,
    `num_attention_heads`, `vocab_size`, optional `num_key_value_heads` (default: no GQA) and `head_dim`
    (default hidden_size / num_attention_heads). Attention score/value BMMs are not linear layers and are
    not included. The dgrad of the first layer is counted although its input is the embedding output:
    the embedding needs that gradient.
    """
    if _is_model(config) or getattr(config, "model_type", "llama") != "llama":
        return model_gemm_shapes(config, micro_batch, seq_len)
    dims = model_dims(config)
    micro_batch = _positive_int("micro_batch", micro_batch)
    seq_len = _positive_int("seq_len", seq_len)
    if not isinstance(gated_mlp, bool):
        raise ValueError(f"gated_mlp must be True or False, got {gated_mlp!r}")
    tokens = micro_batch * seq_len
    hidden, inter, layers = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    q_width = dims["num_attention_heads"] * dims["head_dim"]
    qkv_width = (dims["num_attention_heads"] + 2 * dims["num_key_value_heads"]) * dims["head_dim"]
    linears = [  # (layer, in, out, occurrences per step)
        ("qkv", hidden, qkv_width, layers),
        ("attn_out", q_width, hidden, layers),
        ("mlp_up", hidden, 2 * inter if gated_mlp else inter, layers),
        ("mlp_down", inter, hidden, layers),
        ("lm_head", hidden, dims["vocab_size"], 1),
    ]
    shapes = []
    for layer, fan_in, fan_out, count in linears:
        shapes += [GemmShape(layer, "fprop", tokens, fan_in, fan_out, count),
                   GemmShape(layer, "dgrad", tokens, fan_out, fan_in, count),
                   GemmShape(layer, "wgrad", fan_out, tokens, fan_in, count)]
    return shapes


def _is_model(obj) -> bool:
    import torch
    return isinstance(obj, torch.nn.Module)


def model_gemm_shapes(model_or_config: Any, micro_batch: int, seq_len: int) -> list[GemmShape]:
    """The GEMMs of one micro-batch training step of any transformers causal LM, read from its modules
    (training.model.matmul_layers; a config is built on the meta device). `layer` is the weight's role in a
    block ("self_attn.q_proj", "mlp.experts.gate_up_proj") or "lm_head". An MoE's experts are one grouped GEMM
    per pass whose rows are the tokens times top-k: their row counts per expert depend on the routing, their
    sum (and so the FLOPs) does not."""
    from training.model import matmul_layers, meta_model
    micro_batch = _positive_int("micro_batch", micro_batch)
    seq_len = _positive_int("seq_len", seq_len)
    model = model_or_config if _is_model(model_or_config) else meta_model(model_or_config)
    tokens = micro_batch * seq_len
    shapes = []
    for m in matmul_layers(model):
        rows = tokens * m.rows_per_token
        shapes += [GemmShape(m.role, "fprop", rows, m.fan_in, m.fan_out, m.count),
                   GemmShape(m.role, "dgrad", rows, m.fan_out, m.fan_in, m.count),
                   GemmShape(m.role, "wgrad", m.fan_out, rows, m.fan_in, m.count)]
    return shapes


_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*[xX×]\s*(\d+)\s*$")


def parse_shapes(text: str) -> list[GemmShape]:
    """`"MxKxN,MxKxN"` → GEMMs timed as given (fprop layout: A row-major, B = Wᵀ), count 1 each."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("shapes must be a comma-separated list like '8192x4096x14336,64x128x96'")
    shapes = []
    for item in text.split(","):
        match = _SHAPE_RE.match(item)
        if not match:
            raise ValueError(f"bad GEMM shape {item.strip()!r}: write M x K x N as e.g. 8192x4096x14336")
        m, k, n = (int(g) for g in match.groups())
        if min(m, k, n) < 1:
            raise ValueError(f"GEMM shape {item.strip()!r} has a zero dimension; M, K and N must be >= 1")
        shapes.append(GemmShape(CUSTOM_LAYER, "fprop", m, k, n, 1))
    return shapes
