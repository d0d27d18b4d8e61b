"""The models the lab trains: Llama presets and custom dims through transformers `LlamaForCausalLM` (SDPA
attention, untied LM head), or any transformers causal-LM architecture from a config.json (`model_config`,
`build_model`) or a checkpoint folder (`load_pretrained`). Code that needs the model's parts finds them by
structure (`decoder_blocks`, `decoder_body`, the head through `get_output_embeddings`), not by Llama names;
the fused QKV / gate-up projections below are Llama's own (`LLAMA_ONLY` in training.setup refuses them elsewhere).

Presets (`PRESETS`, dims in training.config.MODEL_PRESETS): `1b` is the 1.14B shape (hidden 2048, 16 blocks,
16 heads / 8 KV heads, FFN 8192) that bench/train_bench.py times against the reference HF Llama stack; `tiny`
is for CPU tests.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM
# The module object itself, imported here (outside compiled code): an import inside a compiled forward goes
# through transformers' lazy package module, which Dynamo cannot trace ("Bad import result: _LazyModule"),
# and each layer's graph broke in two there.
from transformers.models.llama import modeling_llama as _llama

from training.config import MODEL_PRESETS, ModelSpec, SpecError
from training.rope_triton import HAVE_TRITON, auto_one_pass, split_qkv_rope

PRESETS = MODEL_PRESETS  # defined in training.config so spec validation stays import-light


# Plain RoPE does not depend on max_position_embeddings, but lm-eval takes it as the longest context it may
# feed: a model trained on short windows must still accept a multiple-choice ending longer than them.
EVAL_MIN_CONTEXT = 2048
# The longest context a model was trained on, recorded in its config (config.json of every checkpoint): the
# evaluation windows perplexity-type tasks (plab_heldout_bpb) at it, so their bits per byte are measured on the
# positions the model learned, as its validation loss is (training.evaluation.adapter). Set for a model trained
# from random weights (data.seq_len) and carried on by continued training (the larger of the two); a pretrained
# checkpoint without it keeps its own context.
TRAINED_CONTEXT_ATTR = "plab_trained_context"

def llama_config(model: str | dict | ModelSpec, vocab_size: int, seq_len: int) -> LlamaConfig:
    """LlamaConfig for a preset name, a custom-dims dict or a ModelSpec.

    A preset takes `vocab_size`; a custom dict's own `vocab_size` key wins when set.
    """
    if isinstance(model, ModelSpec):
        model = model.to_value()
    if isinstance(model, str):
        if model not in PRESETS:
            raise SpecError(f"unknown model preset {model!r}; use one of {list(PRESETS)}")
        dims = dict(PRESETS[model])
    elif isinstance(model, dict):
        dims = ModelSpec.from_value(model).__dict__.copy()
        dims.pop("preset")
        dims = {k: v for k, v in dims.items() if v is not None}
    else:
        raise SpecError(f"model must be a preset name or a dict, got {model!r}")
    vocab = dims.pop("vocab_size", None) or vocab_size
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2:
        raise SpecError(f"vocab_size must be an integer >= 2, got {vocab!r}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise SpecError(f"seq_len must be a positive integer, got {seq_len!r}")
    cfg = LlamaConfig(
        vocab_size=vocab, max_position_embeddings=max(seq_len, EVAL_MIN_CONTEXT), tie_word_embeddings=False,
        rms_norm_eps=1e-5, initializer_range=0.02, attention_bias=False, mlp_bias=False,
        use_cache=False, bos_token_id=None, eos_token_id=None, pad_token_id=None, **dims,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def model_config(model: ModelSpec, vocab_size: int, seq_len: int):
    """The transformers config of the spec's model: `llama_config` for a preset or custom dims, else the
    config.json that `model.config` or `model.init_from` names (any causal-LM architecture transformers
    knows), set up for training (no KV cache, SDPA attention where the architecture has it)."""
    if model.source == "preset":
        config = llama_config(model, vocab_size, seq_len)
        setattr(config, TRAINED_CONTEXT_ATTR, seq_len)
        return config
    from transformers import AutoConfig
    path = model.config_file() if model.source == "config" else model.checkpoint_dir() / "config.json"
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise SpecError(f"model.{'config' if model.source == 'config' else 'init_from'}: cannot read "
                        f"{str(path)!r} as a transformers config: {exc}") from None
    prepare_for_training(config)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise SpecError(f"data.seq_len ({seq_len}) exceeds the model's max_position_embeddings ({limit}) from "
                        f"{str(path)!r}; lower data.seq_len")
    before = getattr(config, TRAINED_CONTEXT_ATTR, None)
    if model.source == "config":
        setattr(config, TRAINED_CONTEXT_ATTR, seq_len)
    elif isinstance(before, int) and before > 0:
        setattr(config, TRAINED_CONTEXT_ATTR, max(before, seq_len))
    return config


def prepare_for_training(config):
    """`config` (any causal-LM architecture) set up for training, in place: no KV cache, SDPA attention
    (FlashAttention/cuDNN kernels on GPU) wherever the architecture implements it. Returns it."""
    cls = causal_lm_class(config)
    config.use_cache = False
    config._attn_implementation = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    return config


def causal_lm_class(config):
    """The transformers causal-LM class of `config` (SpecError naming the supported types if none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise SpecError(f"model type {getattr(config, 'model_type', type(config).__name__)!r} has no causal-LM class "
                        f"in transformers {__import__('transformers').__version__}; the lab trains decoder-only "
                        f"causal LMs (llama, mistral, qwen2, qwen3, gemma2, phi3, olmo2, gpt_neox, mixtral, "
                        f"qwen2_moe, ...); for a multimodal checkpoint give its text model's config") from None


def build_model(config, seed: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """FP32 causal LM of `config`'s architecture, initialised from `seed` only, on CPU unless another
    `device` is given.

    Initialising on CPU in FP32 (then moving) makes the initial weights independent of the device and
    of the recipe applied afterwards, so every recipe of an experiment starts from the same point; on a GPU
    they depend on the kind of GPU too, not on the recipe (`training.init_device`).
    The global RNG is forked so that building a model does not perturb the caller's random stream.
    """
    device = torch.device(device)
    cls = causal_lm_class(config)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = cls(config)
    model.to(torch.float32)
    return model


def load_pretrained(path, config, seed: int) -> torch.nn.Module:
    """The FP32 CPU model of the Hugging Face checkpoint folder `path` (safetensors; a sharded index too), for
    continued pre-training: every recipe starts from these same weights. A weight the checkpoint lacks is an
    error (it would be initialised at random, differently from the checkpoint's model); the RNG is forked and
    seeded anyway so nothing the loader draws depends on the caller's stream."""
    cls = causal_lm_class(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, info = cls.from_pretrained(str(path), config=config, dtype=torch.float32, local_files_only=True,
                                          use_safetensors=True, output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise SpecError(f"model.init_from {str(path)!r} lacks weights {missing[:5]} of its own config's "
                        f"{cls.__name__}; give a complete checkpoint (save_pretrained writes one)")
    model.to(torch.float32)
    return model


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's blocks, found by structure rather than by one architecture's attribute names: the
    shallowest nn.ModuleList of the model whose length is config.num_hidden_layers (`model.layers` in Llama,
    Qwen, Mistral, Gemma, Phi-3, OLMo-2; `gpt_neox.layers` in GPT-NeoX)."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    found = [(name.count("."), name, module) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module) > 0 and (n is None or len(module) == n)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no list of {n if n is not None else 'decoder'} blocks "
                         f"(an nn.ModuleList) to convert; the lab trains decoder-only transformers")
    return min(found, key=lambda f: f[:2])[2]


def decoder_body(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder without its LM head (`model.model` in Llama; `model.gpt_neox` in GPT-NeoX)."""
    return getattr(model, model.base_model_prefix)


@dataclass(frozen=True)
class MatmulLayer:
    """The weight of one GEMM of the forward, found in a model's modules (`matmul_layers`)."""
    role: str                # its path inside a block, block index dropped ("self_attn.q_proj"), or "lm_head"
    fan_in: int
    fan_out: int
    rows_per_token: int = 1  # GEMM rows each token contributes: 1, or top-k for an MoE's experts
    count: int = 1           # how many times the model has it (blocks holding it)


def meta_model(config) -> torch.nn.Module:
    """`config`'s causal LM on the meta device: its real modules, no memory."""
    with torch.device("meta"):
        return causal_lm_class(config)(config)


# A state-space layer's own matrices: Mamba-1's A_log is (d_inner, d_state), but the selective scan multiplies it
# element-wise with each token's step size - no token x weight GEMM (its projections are nn.Linear, counted).
SSM_STATE_PARAMS = frozenset({"A_log", "A", "D", "dt_bias"})


def matmul_layers(model: torch.nn.Module) -> list[MatmulLayer]:
    """Every weight the forward multiplies activations by, from the model's modules (build it with
    `meta_model`; a recipe's converted modules are not nn.Linear): nn.Linear modules, 2-D weights a module
    applies itself (an MoE router's F.linear), 3-D batched expert weights (each token goes through
    config.num_experts_per_tok of them; (experts, out, in), or (experts, in, out) for experts transformers marks
    transposed), and the LM head; embeddings are lookups, not GEMMs, and biases, convolutions' weights and a
    state-space scan's matrices (SSM_STATE_PARAMS) are not GEMM weights either. Grouped by role and shape, in
    model order."""
    blocks = decoder_blocks(model)
    head = model.get_output_embeddings()
    top_k = getattr(model.config, "num_experts_per_tok", None)
    found: dict[tuple, int] = {}
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    places = [(f"{i}", b) for i, b in enumerate(blocks)] + [("", model)]
    for prefix, root in places:
        for path, module in root.named_modules():
            if (prefix == "" and id(module) in in_blocks) or isinstance(module, torch.nn.Embedding):
                continue
            role = "lm_head" if module is head else path
            if isinstance(module, torch.nn.Linear):
                key = (role, module.in_features, module.out_features, 1)
                found[key] = found.get(key, 0) + 1
                continue
            if isinstance(module, torch.nn.modules.conv._ConvNd):
                continue  # a (depthwise) convolution, e.g. a linear-attention layer's: no token x weight GEMM
            for pname, p in module.named_parameters(recurse=False):
                if "bias" in pname or pname in SSM_STATE_PARAMS:
                    continue  # added, not multiplied (GPT-OSS's per-expert biases are 2-D); a scan's state matrix
                if p.dim() == 3:
                    if not isinstance(top_k, int):
                        raise ValueError(f"{type(module).__name__}.{pname} holds batched expert weights but "
                                         f"the config has no num_experts_per_tok to count their GEMMs by")
                    # (experts, out, in), or (experts, in, out) where transformers marks the experts transposed
                    # (`use_experts_implementation(is_transposed=True)`: GPT-OSS computes x @ W[e])
                    out_dim, in_dim = (2, 1) if getattr(module, "is_transposed", False) else (1, 2)
                    key = (f"{role}.{pname}", p.shape[in_dim], p.shape[out_dim], top_k)
                elif p.dim() == 2:
                    key = (f"{role}.{pname}", p.shape[1], p.shape[0], 1)
                else:
                    continue
                found[key] = found.get(key, 0) + 1
    return [MatmulLayer(role, fi, fo, rows, count) for (role, fi, fo, rows), count in found.items()]


def describe_model(model: torch.nn.Module, spec: ModelSpec) -> dict:
    """What the run trains, for its metadata: architecture, parameters and where the model came from."""
    source = spec.source
    origin = {"preset": spec.preset or "custom", "config": spec.config, "checkpoint": spec.init_from}[source]
    return {"architecture": type(model).__name__, "model_type": getattr(model.config, "model_type", None),
            "params": count_parameters(model), "source": source, "origin": origin,
            "blocks": len(decoder_blocks(model)), "vocab_size": model.config.vocab_size}


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean CE(hidden @ weightᵀ, targets), computed over token chunks with its gradient in the forward.

    The standard path materialises the (tokens x vocab) logits in BF16, upcasts them to FP32 and keeps
    them for the backward (8192 x 32000 tokens: 0.5 + 1 GiB written and read again). Here each chunk's
    logits live only inside the loop; the gradients w.r.t. hidden and weight are formed right away
    (softmax - onehot), the pattern of Liger-Kernel's fused linear cross-entropy. Matmuls run in
    `compute_dtype` (BF16 under autocast) with FP32 softmax, like the autocast path.

    `weight_grad` says how the LM head's weight gradient is formed:
    - "one_gemm" (the default): each chunk writes its dL/dlogits (in `compute_dtype`) into one (tokens x vocab)
      buffer, and one GEMM over all tokens forms dL/dW after the last chunk, accumulating in FP32 inside the GEMM
      and rounding once, as the standard path's backward does. The buffer is tokens x vocab x 2 bytes while the
      loss runs (8192 x 32000: 0.5 GiB); the gradient kept for the backward is then in `compute_dtype`.
    - "per_chunk": each chunk's dL/dW (a GEMM rounded to `compute_dtype`) is added to an FP32 accumulator of the
      weight's shape: a pass over that accumulator per chunk (~1 ms a step at 32000 x 2048, 4 chunks, on an
      H100), two roundings, and no tokens x vocab buffer (for memory-tight runs with a large vocabulary).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, compute_dtype, chunk_fn=None, weight_grad="one_gemm"):
        n = hidden.shape[0]
        h = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(h)
        if weight_grad == "one_gemm":
            chunk_fn = chunk_fn or _ce_chunk_into
            g_all = torch.empty((n, w.shape[0]), dtype=compute_dtype, device=hidden.device)
            for s in range(0, n, chunk):
                g = g_all[s:s + chunk]
                loss = loss + chunk_fn(h[s:s + chunk], w, targets[s:s + chunk], g)
                grad_h[s:s + chunk] = g @ w
            grad_w = g_all.t() @ h   # every token in one GEMM: FP32 accumulation inside it, one rounding
            del g_all
        else:
            chunk_fn = chunk_fn or _ce_chunk
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for s in range(0, n, chunk):
                part, gh, grad_w = chunk_fn(h[s:s + chunk], w, targets[s:s + chunk], grad_w)
                loss = loss + part
                grad_h[s:s + chunk] = gh
        ctx.save_for_backward(grad_h, grad_w)
        ctx.n = n
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        if grad_w.dtype == torch.float32:   # per_chunk's FP32 accumulator (or an FP32 run)
            grad_w = (grad_w * scale).to(ctx.dtypes[1])
        else:
            grad_w = _scaled_cast(grad_w, scale, ctx.dtypes[1])
        return (grad_h * scale).to(ctx.dtypes[0]), grad_w, None, None, None, None, None


def _scale_in_fp32(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


@functools.cache
def _compiled(fn):
    """`fn` under torch.compile with static shapes, compiled once per function (dynamo's own cache per shape)."""
    return torch.compile(fn, dynamic=False)


def _scaled_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale in FP32, rounded once to `dtype` (x in BF16, scale a 0-d FP32 tensor on x's device). On a GPU one
    compiled pass: eager's `x * scale` with a BF16 x and an FP32 0-d tensor on the device runs torch's unvectorized
    casting kernel (0.35 ms for the 1b LM head's 32000 x 2048 gradient on an H200, ~6x its bytes)."""
    if x.device.type != "cuda" or torch.compiler.is_compiling():   # (inside a compiled graph inductor fuses it)
        return _scale_in_fp32(x, scale, dtype)
    return _compiled(_scale_in_fp32)(x, scale, dtype)


def _ce_chunk_into(hc: torch.Tensor, w: torch.Tensor, tc: torch.Tensor, g_out: torch.Tensor):
    """One chunk of the fused loss (`weight_grad: one_gemm`): the summed CE, with dL/dlogits written into `g_out`,
    the chunk's rows of the (tokens x vocab) buffer that the LM head's weight gradient is formed from in one GEMM
    after the last chunk; the caller forms dL/dh = g_out @ w from there. Under torch.compile the softmax's kernel
    stores the gradient straight into `g_out`. Had this function also returned g @ w, inductor would have stored
    the gradient twice (into `g_out` and into a buffer of its own for the GEMM): 0.13 GB more per chunk at 2048
    tokens x 32000. Same values as `_ce_chunk`'s loss and dL/dh."""
    logits = (hc @ w.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
    p = torch.exp(logits - lse[:, None])
    target = torch.arange(logits.shape[1], device=logits.device)[None, :] == tc[:, None]
    g_out.copy_(torch.where(target, p - 1.0, p))
    return loss


def _ce_chunk(hc: torch.Tensor, w: torch.Tensor, tc: torch.Tensor, grad_w: torch.Tensor):
    """One chunk of the fused loss for logits = hc @ wᵀ (FP32 softmax): (summed CE, dL/dh, grad_w + dL/dW).

    The chunk's dL/dW (a GEMM in hc's dtype) is upcast and added to the FP32 accumulator `grad_w` here, so
    that under torch.compile the upcast and the add are one pass over the (vocab x hidden) gradient (read the
    GEMM's output and the accumulator, write the sum) rather than an upcast copy and a separate FP32 add
    outside the graph (~1 ms per step at 32000 x 2048 and 4 chunks on an H100). Same operations, same bits.

    dL/dlogits = softmax - onehot is one elementwise select (p - 1 at the target, p elsewhere; the same FP32 value
    as adding -1 there), so the softmax's kernel writes it straight in hc's dtype. A scatter_add of -1 into the
    FP32 softmax (as before 2026-11-27) made inductor write the softmax in FP32 and convert it in a pass of its
    own: ~0.5 GB more traffic per chunk at 2048 tokens x 32000."""
    logits = (hc @ w.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
    p = torch.exp(logits - lse[:, None])
    target = torch.arange(logits.shape[1], device=logits.device)[None, :] == tc[:, None]
    g = torch.where(target, p - 1.0, p).to(hc.dtype)
    return loss, g @ w, grad_w + (g.t() @ hc).float()


LOSS_WEIGHT_GRADS = ("one_gemm", "per_chunk")


def compiled_ce_chunk(weight_grad: str = "one_gemm"):
    """The fused loss's chunk function for `weight_grad` (`_ce_chunk_into` or `_ce_chunk`) under torch.compile
    (the softmax, its upcast and the one-hot fused into few kernels), for models whose layers are compiled one by
    one rather than as one graph with the loss."""
    return _compiled({"one_gemm": _ce_chunk_into, "per_chunk": _ce_chunk}[weight_grad])


# Config fields by which an architecture's forward changes the logits after the LM head (Gemma 2/3 soft-cap
# them, Cohere and Granite scale them): such models compute the loss from their own forward's logits.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def logit_transform(config) -> str | None:
    """The LOGIT_TRANSFORMS field `config` sets (None: the logits are exactly the LM head's output)."""
    return next((f for f in LOGIT_TRANSFORMS if getattr(config, f, None) not in (None, 1, 1.0)), None)


# ---------------------------------------------------------------------------------------------------
# transformers' packed-sequence check without its host sync
_UNPACKED = {"on": False}


def _install_unpacked_bypass() -> bool:
    """Wrap `transformers.masking_utils.find_packed_sequence_indices` (once) so that, while `_UNPACKED["on"]`,
    it answers "no packed sequences" without looking. transformers calls it on every forward without an
    attention mask; it ends in `if (mask[:, -1] == 0).all()`, a device-to-host copy that waits for the GPU to
    finish everything queued (the previous step's backward and optimizer) before the host may launch the
    forward. False where this transformers has no such function (nothing to bypass)."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        return False
    if getattr(original, "plab_bypass", False):
        return True

    def find_packed_sequence_indices(position_ids):
        return None if _UNPACKED["on"] else find_packed_sequence_indices.__wrapped__(position_ids)

    find_packed_sequence_indices.plab_bypass = True
    find_packed_sequence_indices.__wrapped__ = original
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    return True


class _PositionsUnpacked:
    """While active, the model's forward is known to run on positions 0..T-1 in every row (CausalLMLoss never
    passes position ids: the model makes them with `arange`), which is exactly when transformers' check
    returns None. Not re-entrant across threads; the training loop calls the model from one thread."""

    def __enter__(self):
        self.before, _UNPACKED["on"] = _UNPACKED["on"], True

    def __exit__(self, *exc):
        _UNPACKED["on"] = self.before


class CausalLMLoss(torch.nn.Module):
    """Wraps a causal LM so that forward(input_ids, targets) returns the mean next-token loss.

    One module around the whole computation so DDP and torch.compile see the loss too (compiling the
    cross-entropy with the model lets inductor fuse the FP32 upcast into the softmax).
    """

    def __init__(self, model: torch.nn.Module, *, fused_loss: bool = True, chunk_tokens: int = 2048,
                 compute_dtype: torch.dtype | None = None, sync_free_mask: bool = True,
                 weight_grad: str = "one_gemm"):
        """`compute_dtype`: the dtype of the LM-head matmuls in the fused loss (BF16 when the caller runs
        under BF16 autocast; None = the hidden states' dtype). Fixed here rather than queried from the
        autocast state inside forward, so torch.compile sees a constant. `sync_free_mask`: answer
        transformers' packed-sequence check without its host sync (PerfOptions.sync_free_mask).
        `weight_grad`: how the fused loss forms the LM head's weight gradient (LOSS_WEIGHT_GRADS;
        `_ChunkedLinearCrossEntropy` says what each one costs)."""
        super().__init__()
        if weight_grad not in LOSS_WEIGHT_GRADS:
            raise ValueError(f"weight_grad must be one of {list(LOSS_WEIGHT_GRADS)}, got {weight_grad!r}")
        self.weight_grad = weight_grad
        self.assume_unpacked = sync_free_mask and _install_unpacked_bypass()
        self.compute_dtype = compute_dtype
        self.model = model
        # Logits transformed after the head (soft-capping) go through the model's own forward.
        self.plain_head = logit_transform(model.config) is None
        # A recipe that replaced the LM head (none should: it stays BF16 by convention) keeps the
        # standard path, since the fused loss reads the head's weight directly.
        self.fused = fused_loss and self.plain_head and type(model.get_output_embeddings()) is torch.nn.Linear
        self.chunk_tokens = chunk_tokens
        self.chunk_fn = None  # None = the eager chunk function (traced into the graph when the whole model is compiled)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Also while Dynamo traces the whole loss module (compile_scope "model"): there transformers skips its
        # check's `.all()` but then assumes packed sequences and builds a full boolean mask, so SDPA lost its causal
        # fast path (and GQA its un-repeated K/V); with the answer known the traced graph keeps `is_causal=True`.
        if self.assume_unpacked:
            with _PositionsUnpacked():
                return self._forward(input_ids, targets)
        return self._forward(input_ids, targets)

    def _forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self.plain_head:
            logits = self.model(input_ids=input_ids).logits
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        hidden = decoder_body(self.model)(input_ids=input_ids).last_hidden_state
        head = self.model.get_output_embeddings()
        # Without autograd (validation) the fused path would still form gradients: use the plain one.
        if self.fused and torch.is_grad_enabled():
            dtype = self.compute_dtype or hidden.dtype
            return _ChunkedLinearCrossEntropy.apply(hidden.flatten(0, 1), head.weight,
                                                    targets.flatten(), self.chunk_tokens, dtype, self.chunk_fn,
                                                    self.weight_grad)
        logits = head(hidden)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def compile_layers(loss_module: "CausalLMLoss", mode: str | None = None) -> None:
    """Regional compilation: each decoder layer's forward compiled on its own (the same code for every
    layer, so it compiles once and is reused), plus the fused loss's chunk math. Module hooks then run
    between layers (the overlapped optimizer step waits there), and compile time drops several-fold."""
    for layer in decoder_blocks(loss_module.model):
        layer.forward = torch.compile(layer.forward, mode=mode)
    loss_module.chunk_fn = compiled_ce_chunk(loss_module.weight_grad)


def _to_bf16(module, inputs, output):
    return output.to(torch.bfloat16)


def carry_residual_in_bf16(model: torch.nn.Module):
    """Cast the embedding output to BF16 so the residual stream that starts there stays BF16 (see
    PerfOptions.bf16_residual). Returns the hook handle (`.remove()` undoes it)."""
    return model.get_input_embeddings().register_forward_hook(_to_bf16)


# ---------------------------------------------------------------------------------------------------
# Fused QKV projection (Megatron / Transformer Engine's `linear_qkv`)
QKV_NAMES = ("q_proj", "k_proj", "v_proj")


def _fused_qkv_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args,
                                 **kwargs):
    """LlamaAttention.forward with one GEMM for Q, K and V (transformers' own RoPE and attention kernels)."""
    ml = _llama
    for cache_key in ("past_key_values", "past_key_value"):
        if kwargs.pop(cache_key, None) is not None:
            raise NotImplementedError("a model with a fused QKV projection has no KV cache: generate from its "
                                      "HF checkpoint (saved with separate q/k/v weights) instead")
    kwargs.pop("cache_position", None)
    kwargs.pop("use_cache", None)
    input_shape = hidden_states.shape[:-1]
    cos, sin = position_embeddings
    # A recipe may run the projection and RoPE itself (fp8_delayed's fused_qkv_rope): (q, k, v) [batch, tokens, heads,
    # head_dim], or None where its own conditions do not hold.
    qkv_rope = getattr(self, "qkv_rope", None)
    fused = qkv_rope(hidden_states, cos, sin) if qkv_rope is not None else None
    if fused is not None:
        q, k, v = (t.transpose(1, 2) for t in fused)
    else:
        # RoPE's backward, the slices' and the concatenation's as one pass where training.perf.rope_backward says
        q, k, v = split_qkv_rope(self.qkv_proj(hidden_states), cos, sin, self.qkv_split, self.head_dim,
                                 getattr(self, "rope_one_pass", False))
    impl = self.config._attn_implementation
    attention = ml.eager_attention_forward if impl == "eager" else ml.ALL_ATTENTION_FUNCTIONS[impl]
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                             self.attention_dropout, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def fuse_qkv(model: LlamaForCausalLM) -> int:
    """Replace each attention block's q_proj, k_proj and v_proj by one `qkv_proj` linear whose weight is
    their concatenation [Wq; Wk; Wv] (same values, same output). One GEMM of width (heads + 2 kv_heads) x
    head_dim instead of three, the two narrow K/V ones included, and one Dgrad instead of three plus their
    sum. Recipes then quantize the fused weight as one tensor, as Transformer Engine does with Megatron's
    `linear_qkv`. HF checkpoints are still written with separate q/k/v weights (`split_fused_qkv`).
    Returns the number of blocks fused."""
    n = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "qkv_proj"):
            continue
        attn.qkv_split = [getattr(attn, name).out_features for name in QKV_NAMES]
        _replace_by_concatenation(attn, QKV_NAMES, "qkv_proj", "fuse_qkv")
        attn.forward = _fused_qkv_attention_forward.__get__(attn)
        n += 1
    return n


def set_rope_backward(model: torch.nn.Module, mode: str, on_cuda: bool) -> str | None:
    """training.perf.rope_backward on the blocks with a fused QKV projection (fuse_qkv), after the recipe converted
    them: "one_pass" runs RoPE's backward and the concatenation of dQ, dK and dV as one pass (training.rope_triton),
    "compiled" leaves them to the compiler; "auto" is one_pass on a GPU where that keeps the compiled path's values
    (training.rope_triton.auto_one_pass: a BF16 linear, MXFP8's emulated one). Returns what holds: "one_pass",
    "compiled", "one_pass on N of M blocks", or None where no block has a fused QKV projection."""
    attns = (getattr(layer, "self_attn", None) for layer in decoder_blocks(model))
    fused = [a for a in attns if getattr(getattr(a, "forward", None), "__func__", None) is _fused_qkv_attention_forward]
    if not fused:
        return None
    for attn in fused:
        attn.rope_one_pass = mode == "one_pass" or (mode == "auto" and on_cuda and HAVE_TRITON
                                                    and auto_one_pass(attn.qkv_proj))
    n = sum(attn.rope_one_pass for attn in fused)
    return "one_pass" if n == len(fused) else "compiled" if n == 0 else f"one_pass on {n} of {len(fused)} blocks"


def _replace_by_concatenation(parent: torch.nn.Module, names, fused_name: str, caller: str) -> None:
    """Replace the linears `parent.<names>` by one linear `parent.<fused_name>` whose weight (and bias) is
    their concatenation along the output dim, in that order."""
    parts = [getattr(parent, name) for name in names]
    if any(type(p) is not torch.nn.Linear for p in parts):
        raise ValueError(f"{caller} must run before a recipe converts the linears")
    w = torch.cat([p.weight.detach() for p in parts], dim=0)
    has_bias = parts[0].bias is not None
    fused = torch.nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(w)
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
    for name in names:
        delattr(parent, name)
    setattr(parent, fused_name, fused)


# ---------------------------------------------------------------------------------------------------
# Fused gate/up projection (Megatron / Transformer Engine's `linear_fc1`)
GATE_UP_NAMES = ("gate_proj", "up_proj")


def _fused_mlp_forward(self, x):
    """LlamaMLP.forward with one GEMM for the gate and up projections: down(act(gate) * up)."""
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def fuse_gate_up(model: LlamaForCausalLM) -> int:
    """Replace each MLP's gate_proj and up_proj by one `gate_up_proj` linear with weight [Wgate; Wup] (same
    values, same output): one GEMM of width 2 x intermediate for Fprop and Wgrad and one Dgrad instead of two
    plus their sum, and for a low-precision recipe one quantization of the MLP input instead of two; recipes
    then scale the fused weight as one tensor, as Transformer Engine does with Megatron's `linear_fc1` (the
    `mlp_up` shape of training.gemm). HF checkpoints keep separate gate/up weights (`split_fused`).
    Returns the number of blocks fused."""
    n = 0
    for layer in model.model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj"):
            continue
        _replace_by_concatenation(mlp, GATE_UP_NAMES, "gate_up_proj", "fuse_gate_up")
        mlp.forward = _fused_mlp_forward.__get__(mlp)
        n += 1
    return n


# (marker in a fused parameter's name, the HF names of its parts in order)
FUSED_PROJECTIONS = ((".qkv_proj.", QKV_NAMES), (".gate_up_proj.", GATE_UP_NAMES))


def _fused_parts(config: LlamaConfig):
    """FUSED_PROJECTIONS with each part's size along dim 0."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = {".qkv_proj.": [config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim,
                            config.num_key_value_heads * head_dim],
             ".gate_up_proj.": [config.intermediate_size, config.intermediate_size]}
    return tuple((marker, names, sizes[marker]) for marker, names in FUSED_PROJECTIONS)


def split_fused(state: dict, config: LlamaConfig) -> dict:
    """State-dict names of a fused model -> HF names: `...self_attn.qkv_proj.X` becomes q/k/v_proj.X and
    `...mlp.gate_up_proj.X` becomes gate_proj.X and up_proj.X. Only Llama models are fused here: another
    architecture's own `qkv_proj` / `gate_up_proj` (Phi-3's) are its HF names and stay as they are."""
    if getattr(config, "model_type", None) != "llama":
        return dict(state)
    fused = _fused_parts(config)
    out = {}
    for name, value in state.items():
        for marker, names, sizes in fused:
            if marker in name:
                prefix, suffix = name.split(marker)
                for part, tensor in zip(names, value.split(sizes, dim=0)):
                    out[f"{prefix}.{part}.{suffix}"] = tensor
                break
        else:
            out[name] = value
    return out


def join_fused(weights: dict, name: str) -> torch.Tensor:
    """The tensor for parameter `name` of a (possibly fused) model from HF-named `weights`."""
    if name in weights:  # unfused, or an architecture whose own HF name it is (Phi-3's qkv_proj)
        return weights[name]
    for marker, names in FUSED_PROJECTIONS:
        if marker in name:
            prefix, suffix = name.split(marker)
            return torch.cat([weights[f"{prefix}.{part}.{suffix}"] for part in names], dim=0)
    return weights[name]


# The names from when QKV was the only fused projection.
split_fused_qkv, join_fused_qkv = split_fused, join_fused
