"""Llama-style decoder models through transformers `LlamaForCausalLM` (SDPA attention, untied LM head).

Presets (`PRESETS`, dims in training.config.MODEL_PRESETS) follow ANCHORS.md: `1b` is the 1.14B shape
the reference throughput was measured on; `tiny` is for CPU tests.
"""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from training.config import MODEL_PRESETS, ModelSpec, SpecError

PRESETS = MODEL_PRESETS  # defined in training.config so spec validation stays import-light


# Plain RoPE does not depend on max_position_embeddings, but lm-eval takes it as the longest context it may
# feed: a model trained on short windows must still accept a multiple-choice ending longer than them.
EVAL_MIN_CONTEXT = 2048

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


def build_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """FP32 model on CPU, initialised from `seed` only.

    Initialising on CPU in FP32 (then moving) makes the initial weights independent of the device and
    of the recipe applied afterwards, so every recipe of an experiment starts from the same point.
    The global RNG is forked so that building a model does not perturb the caller's random stream.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = LlamaForCausalLM(config)
    model.to(torch.float32)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean CE(hidden @ weightᵀ, targets), computed over token chunks with its gradient in the forward.

    The standard path materialises the (tokens x vocab) logits in BF16, upcasts them to FP32 and keeps
    them for the backward (8192 x 32000 tokens: 0.5 + 1 GiB written and read again). Here each chunk's
    logits live only inside the loop; the gradients w.r.t. hidden and weight are formed right away
    (softmax - onehot), the pattern of Liger-Kernel's fused linear cross-entropy. Matmuls run in
    `compute_dtype` (BF16 under autocast) with FP32 softmax, like the autocast path.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, compute_dtype):
        n = hidden.shape[0]
        h = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, n, chunk):
            hc, tc = h[s:s + chunk], targets[s:s + chunk]
            logits = (hc @ w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            loss = loss + (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            g = torch.exp(logits - lse[:, None])
            g.scatter_add_(1, tc[:, None], torch.full_like(lse[:, None], -1.0))
            g = g.to(compute_dtype)
            grad_h[s:s + chunk] = g @ w
            grad_w += (g.t() @ hc).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.n = n
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        return (grad_h * scale).to(ctx.dtypes[0]), (grad_w * scale).to(ctx.dtypes[1]), None, None, None


class CausalLMLoss(torch.nn.Module):
    """Wraps a LlamaForCausalLM so that forward(input_ids, targets) returns the mean next-token loss.

    One module around the whole computation so DDP and torch.compile see the loss too (compiling the
    cross-entropy with the model lets inductor fuse the FP32 upcast into the softmax).
    """

    def __init__(self, model: LlamaForCausalLM, *, fused_loss: bool = True, chunk_tokens: int = 2048,
                 compute_dtype: torch.dtype | None = None):
        """`compute_dtype`: the dtype of the LM-head matmuls in the fused loss (BF16 when the caller runs
        under BF16 autocast; None = the hidden states' dtype). Fixed here rather than queried from the
        autocast state inside forward, so torch.compile sees a constant."""
        super().__init__()
        self.compute_dtype = compute_dtype
        self.model = model
        # A recipe that replaced the LM head (none should: it stays BF16 by convention) keeps the
        # standard path, since the fused loss reads lm_head.weight directly.
        self.fused = fused_loss and type(model.lm_head) is torch.nn.Linear
        self.chunk_tokens = chunk_tokens

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.model.model(input_ids=input_ids).last_hidden_state
        # Without autograd (validation) the fused path would still form gradients: use the plain one.
        if self.fused and torch.is_grad_enabled():
            dtype = self.compute_dtype or hidden.dtype
            return _ChunkedLinearCrossEntropy.apply(hidden.flatten(0, 1), self.model.lm_head.weight,
                                                    targets.flatten(), self.chunk_tokens, dtype)
        logits = self.model.lm_head(hidden)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _to_bf16(module, inputs, output):
    return output.to(torch.bfloat16)


def carry_residual_in_bf16(model: LlamaForCausalLM):
    """Cast the embedding output to BF16 so the residual stream that starts there stays BF16 (see
    PerfOptions.bf16_residual). Returns the hook handle (`.remove()` undoes it)."""
    return model.model.embed_tokens.register_forward_hook(_to_bf16)
