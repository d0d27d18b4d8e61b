"""Building a run before its first step: processes and device, data, model and recipe, optimizer, and the
step function (the loss module under DDP and torch.compile as asked). `setup_run` returns one `Run`.

Numerics: FP32 master weights always. `training.param_dtype` "bf16" (the GPU default): the model's
parameters are BF16 and compute in BF16 (recipes replace the GEMMs of converted linears), the optimizer
(training.optim.MasterAdamW) keeps FP32 masters and moments and writes the rounded weights back after
each step. "fp32" (the CPU default): FP32 parameters, forward/backward under BF16 autocast on GPU, plain
FP32 on CPU, torch's fused AdamW.
"""
from __future__ import annotations

import contextlib
import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from training.config import RANDOM_CORPUS, RunSpec, SpecError
from training.data import TokenDataset
from training.distributed import DistContext, init_distributed, init_single_process_group
from training.flops import flops_per_token
from training.model import (QKV_NAMES, CausalLMLoss, build_model, carry_residual_in_bf16, compile_layers,
                            count_parameters, decoder_blocks, decoder_body, describe_model, fuse_gate_up, fuse_qkv,
                            load_pretrained, meta_model, model_config, set_rope_backward)
from training.optim import MasterAdamW, OverlappedOptimizerStep, lr_at
from training.parallel import (OneRankDirectStep, OverlappedShardedStep, apply_activation_checkpointing,
                              keeps_gathered_weights, resolve_parallel, shard_model)
from training.precision import catalog
from training.precision.gemm_ops import has_capability
from training.precision.weight_reuse import QuantizedWeightReuse
from training.sink import MetricSink
from training.devices import device_label


@dataclass
class Run:
    """A run ready for its first step (before any resume)."""
    spec: RunSpec
    ctx: DistContext
    device: torch.device
    device_name: str
    param_dtype: str                   # "bf16" | "fp32", resolved
    autocast: contextlib.AbstractContextManager
    tokenizer: object | None           # None for the synthetic "random" corpus
    dataset: TokenDataset
    model: torch.nn.Module             # the transformers causal LM, converted by the recipe
    report: object                     # the recipe's RecipeReport
    hooks: list                        # the recipe's hooks (post_optimizer_step, post_backward, state)
    params: list[torch.Tensor]         # trainable parameters, in model order
    optimizer: torch.optim.Optimizer
    net: torch.nn.Module               # what a step calls: the loss module, under DDP / torch.compile
    eval_net: torch.nn.Module          # what validation calls: the loss module, compiled when `net` is
    stepper: OverlappedOptimizerStep | OverlappedShardedStep | OneRankDirectStep | None
    parallel: str                      # "single" | "ddp" | "fsdp" (training.parallel, resolved)
    activation_checkpointing: dict     # what training.parallel.apply_activation_checkpointing did
    fused_qkv: bool
    flops_per_token: float
    micro_batch: int
    model_info: dict = field(default_factory=dict)  # training.model.describe_model: architecture, params, source
    compile_mode: str | None = None    # the torch.compile mode the step runs under (None: inductor's default)
    fsdp_keeps_gathered_weights: bool | None = None  # FSDP2 blocks keep their gathered weights to the backward
    cublaslt_workspace: str = "default"  # configure_cublaslt_workspace's result: default | none | env
    rope_backward: str | None = None   # training.model.set_rope_backward's result (None: no fused QKV projection)
    inductor_settings: dict = field(default_factory=dict)  # Recipe.inductor_settings, applied around the loop

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def overlap_optimizer(self) -> bool:
        return isinstance(self.stepper, (OverlappedOptimizerStep, OverlappedShardedStep))

    @property
    def sharded(self) -> bool:
        return self.parallel == "fsdp"

    @property
    def fsdp_one_rank_direct(self) -> bool | None:
        """FSDP2 on one process through OneRankDirectStep (None: not FSDP2)."""
        return isinstance(self.stepper, OneRankDirectStep) if self.sharded else None

    def settle(self) -> None:
        """Before anything reads the weights or optimizer state outside the forward (validation,
        checkpoints, the end): the compute stream waits for the overlapped update to finish."""
        if self.stepper is not None:
            self.stepper.synchronize()

    def info(self) -> dict:
        """What the run is, for the `run_info` event and the result's summary."""
        t = self.spec.training
        return {"params": count_parameters(self.model), "model": dict(self.model_info),
                "flops_per_token": self.flops_per_token,
                "world_size": self.ctx.world, "param_dtype": self.param_dtype, "fused_qkv": self.fused_qkv,
                "fused_gate_up": t.perf.fuse_gate_up, "overlap_optimizer": self.overlap_optimizer,
                "parallel": self.parallel, "activation_checkpointing": self.activation_checkpointing,
                "fsdp_keeps_gathered_weights": self.fsdp_keeps_gathered_weights,
                "fsdp_one_rank_direct": self.fsdp_one_rank_direct,
                "reuse_quantized_weights": any(isinstance(h, QuantizedWeightReuse) for h in self.hooks),
                "compile_mode": self.compile_mode, "cublaslt_workspace": self.cublaslt_workspace,
                "loss_weight_grad": self.loss_weight_grad, "rope_backward": self.rope_backward,
                "inductor_settings": dict(self.inductor_settings), "data": dict(self.dataset.info)}

    @property
    def loss_weight_grad(self) -> str | None:
        """How the fused loss forms the LM head's weight gradient (None: the run does not use the fused loss)."""
        loss_module = getattr(self.eval_net, "_orig_mod", self.eval_net)
        return loss_module.weight_grad if getattr(loss_module, "fused", False) else None


def device_kind(spec: RunSpec) -> str:
    """The kind of device ("cuda" or "cpu") the spec's `training.device` asks for on this machine."""
    requested = spec.training.device
    return "cuda" if requested.startswith("cuda") or (requested == "auto" and torch.cuda.is_available()) else "cpu"


def join_processes(spec: RunSpec) -> DistContext:
    """This process's place among the ranks torchrun started; checks their number against `training.gpus`."""
    gpus, nodes = spec.training.gpus, spec.training.nodes
    ctx = init_distributed(device_kind(spec))
    if ctx.world != 1 and ctx.world != gpus * nodes:
        raise SpecError(f"the spec asks for training.gpus={gpus} on training.nodes={nodes} ({gpus * nodes} processes) "
                        f"but {ctx.world} were launched; launch with torchrun --nnodes {nodes} --nproc-per-node {gpus}")
    if ctx.world == 1 and gpus > 1:
        raise SpecError(f"training.gpus={gpus} needs one process per GPU: launch with "
                        f"`torchrun --nproc-per-node {gpus} -m training SPEC.json --output-dir DIR`")
    if ctx.world == 1 and spec.training.parallel == "fsdp":
        init_single_process_group(device_kind(spec))
    return ctx


def setup_run(spec: RunSpec, ctx: DistContext, sink: MetricSink, *, cache_dir: Path) -> Run:
    """Build everything the loop needs, in an order that fixes the run's numbers: the model is initialised
    from the seed before the recipe converts it; the global generators are seeded once model and optimizer
    exist (nothing after that draws from them before the first step)."""
    t = spec.training
    device = _resolve_device(t.device, ctx)
    _configure_backends(device, t.perf)
    cublaslt_workspace = configure_cublaslt_workspace(device, t.perf, spec.recipe)
    on_cuda = device.type == "cuda"
    device_name = device_label(device)
    param_dtype = t.param_dtype if t.param_dtype != "auto" else ("bf16" if on_cuda else "fp32")
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if on_cuda and param_dtype != "bf16"
                else contextlib.nullcontext())

    config = model_config(spec.model, spec.vocab_size, spec.data.seq_len)
    tokenizer, dataset = load_data(spec, ctx, cache_dir, sink, config)
    parallel = resolve_parallel(t.parallel, ctx.world, count_parameters(meta_model(config)), device)
    model, report, fused_qkv, ac, rope_backward = _model_with_recipe(spec, config, device, param_dtype, sink,
                                                                     fsdp=parallel == "fsdp")
    keep_gathered, direct = None, False
    if parallel == "fsdp":
        # Sharded before the optimizer exists: its state is built on the FP32 shards.
        keep_gathered = keeps_gathered_weights(model, ctx.world, t.perf.fsdp_reshard_after_forward)
        # One process: FSDP2's one-rank copies left out (OneRankDirectStep), unless the update is to overlap.
        net, eval_net = _step_function(model, spec, ctx, device, compile_per_layer=False, parallel=parallel,
                                       bf16_compute=param_dtype == "bf16", keep_gathered=keep_gathered,
                                       one_rank_direct=(t.perf.fsdp_one_rank_direct and ctx.world == 1
                                                        and t.perf.overlap_optimizer is not True))
        direct = bool(getattr(net, "_plab_one_rank_direct", False))
    params, optimizer = _optimizer(model, spec, param_dtype, sharded=parallel == "fsdp")
    # Randomness in the step (NVFP4's stochastic rounding) draws from the global generators: seeded from the run's
    # seed and rank so a spec reproduces its run; a resume restores their exact state from the checkpoint.
    torch.manual_seed(spec.seed * 1_000_003 + ctx.rank)

    overlap_wanted = overlap_update(t.perf.overlap_optimizer, parallel) and not direct
    overlap = on_cuda and param_dtype == "bf16" and overlap_wanted and parallel != "fsdp"
    mode = _compile_mode(t, report, parallel, on_cuda, ac, per_layer=on_cuda and parallel != "fsdp")
    if parallel != "fsdp":
        # Layer by layer on every GPU run, overlapped or not: with the update serial (overlap_optimizer false)
        # the whole-model graph ran the 1b BF16 step in 132.9 ms against 116.2 ms compiled layer by layer
        # (bench/results/train_bench_2026-11-25T1811_*_overlap_ab_at_172e38c.json).
        net, eval_net = _step_function(model, spec, ctx, device, compile_per_layer=on_cuda, parallel=parallel,
                                       compile_mode=mode)
    stepper = OverlappedOptimizerStep(optimizer, _forward_buckets(model, params)) if overlap else None
    # After the stepper: the blocks' reuse hooks must run after its per-block waits.
    hooks = list(getattr(report, "hooks", []) or []) + _weight_reuse(model, t, parallel)
    # Under FSDP2 the update overlaps the next forward unless a recipe hook reads the weights right after it
    # (tensorwise FP8's scale pass for the FP8 all-gather, delayed scaling's history).
    if parallel == "fsdp" and on_cuda and overlap_wanted and not any(
            hasattr(h, "post_optimizer_step") for h in hooks):
        stepper = OverlappedShardedStep(optimizer, net, list(decoder_blocks(model)),
                                        prefetch=ctx.world == 1 and t.perf.fsdp_prefetch, kernel=t.perf.shard_update)
    if direct:
        stepper = OneRankDirectStep(optimizer, [net, *decoder_blocks(model)], kernel=t.perf.shard_update)
    return Run(spec=spec, ctx=ctx, device=device, device_name=device_name, param_dtype=param_dtype,
               autocast=autocast, tokenizer=tokenizer, dataset=dataset, model=model, report=report,
               hooks=hooks, params=params, optimizer=optimizer, net=net, eval_net=eval_net, stepper=stepper,
               parallel=parallel, activation_checkpointing=ac, fused_qkv=fused_qkv,
               flops_per_token=flops_per_token(model.config, spec.data.seq_len),
               micro_batch=t.batch_size // (t.grad_accum * ctx.world),
               model_info=describe_model(model, spec.model), compile_mode=mode,
               fsdp_keeps_gathered_weights=keep_gathered, cublaslt_workspace=cublaslt_workspace,
               rope_backward=rope_backward, inductor_settings=_inductor_settings(spec, model, on_cuda))


def overlap_update(option: bool | None, parallel: str) -> bool:
    """`training.perf.overlap_optimizer` resolved: the run's value when it gives one; auto (None) overlaps the update
    with the next forward under FSDP2 only. On H100s without FSDP2 the overlapped step was never faster: one GPU,
    serial / overlapped, bf16 0.994-1.009x, fp8_tensorwise 1.006x, fp8_delayed 1.010x, fp8_blockwise 1.016x, mxfp8
    1.007x, nvfp4 1.002x, with 2-3 GiB less memory reserved; DDP on 2 GPUs bf16 1.001x, fp8_tensorwise 1.115x (the
    overlapped FP8 step was host-bound). Under FSDP2 on one process the overlap pays: 0.936x against 0.902x the
    unwrapped BF16 (bench/NOTES_floor.md 32, 36, 39). FSDP2's one-rank direct path (`OneRankDirectStep`, setup_run)
    runs it after the backward whatever auto says here: it is as fast as the unwrapped run (NOTES_floor.md 41)."""
    if option is not None:
        return option
    return parallel == "fsdp"


def _compile_mode(t, report, parallel: str, on_cuda: bool, ac: dict, *, per_layer: bool) -> str | None:
    """None when nothing is compiled; `training.perf.compile_mode` when the run names one; else the recipe's own
    (RecipeReport.compile_mode, fp8_blockwise's and fp8_delayed's CUDA graphs) where it has been measured to work:
    one process on a GPU, the layers compiled one by one, no activation checkpointing, no numerics sampling (its
    forward hooks read the layers' inputs eagerly); else inductor's default (None)."""
    if not t.compile:
        return None
    if t.perf.compile_mode is not None:
        return t.perf.compile_mode
    scope_ok = t.perf.compile_scope == "layers" or (t.perf.compile_scope == "auto" and per_layer)
    measured = on_cuda and parallel == "single" and scope_ok and ac.get("mode") == "none" and not t.numerics_every
    return report.compile_mode if measured else None


def _inductor_settings(spec: RunSpec, model, on_cuda: bool) -> dict:
    """The recipe's inductor settings for this run's compiled step (Recipe.inductor_settings); {} uncompiled."""
    if not spec.training.compile:
        return {}
    from training.precision.registry import get_recipe

    return get_recipe(spec.recipe).inductor_settings(model, on_cuda)


def _weight_reuse(model, t, parallel: str) -> list:
    """[QuantizedWeightReuse] when this run quantizes its weights once per step for all its micro-batches."""
    from training.precision.weight_reuse import reuse_applies

    if reuse_applies(t.grad_accum, parallel, t.perf.reuse_quantized_weights) is not None:
        return []
    reuse = QuantizedWeightReuse(list(decoder_blocks(model)), compiled=t.compile)
    if not reuse.blocks:
        reuse.remove()
        return []
    return [reuse]


def check_vocabulary(spec: RunSpec, config, tokenizer) -> None:
    """Before anything trains: every token id the data can hold must index the model's embedding. The data's
    vocabulary is the tokenizer's (or data.vocab_size for the synthetic random corpus)."""
    model_vocab = config.vocab_size
    data_vocab = len(tokenizer) if tokenizer is not None else spec.vocab_size
    if data_vocab <= model_vocab:
        return
    where = {"preset": "raise model.vocab_size or lower data.vocab_size",
             "random": "lower data.vocab_size (the range of the random tokens)",
             "config": f"use a tokenizer of at most {model_vocab} tokens or raise vocab_size in model.config's "
                       f"config.json",
             "checkpoint": f"use the checkpoint's own tokenizer (or one of at most {model_vocab} tokens)"}
    what = "the tokenizer has" if tokenizer is not None else "the random corpus draws from"
    raise SpecError(f"{what} {data_vocab} tokens but the model's vocabulary is only {model_vocab} "
                    f"({type(config).__name__}); {where['random' if tokenizer is None else spec.model.source]}")


def _resolve_device(requested: str, ctx: DistContext) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SpecError(f"training.device is {requested!r} but no CUDA GPU is visible; use 'auto' or 'cpu'")
        if requested == "cuda":
            return torch.device("cuda", ctx.local_rank if ctx.enabled else torch.cuda.current_device())
    return torch.device(requested)


def configure_cublaslt_workspace(device: torch.device, perf, recipe: str | None = None) -> str:
    """Apply `perf.cublaslt_workspace` (see PerfOptions; "auto" resolved for `recipe`) before the run's first GEMM;
    returns what holds: "default", "none", or "env" (CUBLASLT_WORKSPACE_SIZE set by the caller's environment, left
    as it is). A later run in the same process may choose again (see `_drop_cublaslt_workspaces`)."""
    if os.environ.get("CUBLASLT_WORKSPACE_SIZE") is not None and os.environ.get("_PLAB_CUBLASLT_SET") is None:
        return "env"
    if device.type != "cuda":
        return "default"
    choice = perf.cublaslt_workspace
    if choice == "auto":
        choice = _auto_workspace(device, recipe)
    before = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
    if choice == "none":
        os.environ["CUBLASLT_WORKSPACE_SIZE"] = "0"
        os.environ["_PLAB_CUBLASLT_SET"] = "1"  # ours, so a later run in this process may choose again
    elif os.environ.get("_PLAB_CUBLASLT_SET") is not None:
        del os.environ["CUBLASLT_WORKSPACE_SIZE"], os.environ["_PLAB_CUBLASLT_SET"]
    if os.environ.get("CUBLASLT_WORKSPACE_SIZE") != before:
        _drop_cublaslt_workspaces()
    return choice


def _drop_cublaslt_workspaces() -> None:
    """Free torch's cuBLAS/cuBLASLt workspaces when this process's workspace size changes between runs.

    torch's cuBLAS handle pool (aten/src/ATen/cuda/CublasHandlePool.cpp, as read for torch 2.11, the GPU host's)
    reads CUBLASLT_WORKSPACE_SIZE at every cuBLASLt call, but allocates the workspace of each (handle, stream) pair
    once, at the size in effect at that pair's first call, and hands it out again whatever size a later call asks
    for. A pair first used by a "none" run holds no memory, and a later run at torch's default size hands cuBLASLt
    a null workspace said to be 1 MiB. That explains the CUBLAS_STATUS_INVALID_VALUE in cublasLtMatmul of
    fp8_rowwise's and fp8_blockwise's scaled GEMMs after fp8_tensorwise and fp8_delayed runs in one process
    (tests/training/test_fsdp_recipes_gpu.py on an H200, bench/results/gpu_tests_2026-11-28T1420_*). Dropped, each
    workspace is allocated again at the size now in effect. A process that trains one run (the CLI, a worker's job,
    train_bench's per-config processes) sets the size once, before any workspace exists."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()  # no kernel of the last run may still use a workspace when it goes back to the allocator
    clear()


def _auto_workspace(device: torch.device, recipe: str | None) -> str:
    """What "auto" means for `recipe` on `device`: its catalog entry's choice where its real kernels run (that is
    where the choice was measured and curve-tested: FP8 GEMMs on an sm_89+ GPU); torch's default elsewhere, where
    the recipe's GEMMs are BF16 on emulated operands and cuBLASLt's workspace may matter to them (split-K)."""
    if recipe not in catalog.recipe_names():
        return "default"
    entry = catalog.get(recipe)
    return entry.cublaslt_workspace if has_capability(device, entry.real_min_capability) else "default"


def _configure_backends(device: torch.device, perf) -> None:
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = perf.allow_tf32
    torch.backends.cudnn.allow_tf32 = perf.allow_tf32
    set_sdpa_backends(perf.sdpa_backend)


# torch's SDPA backend flags (process-wide) as they were before a run first pinned one; None while none is pinned.
_sdpa_before_pin: dict[str, bool] | None = None
_SDPA_FLAGS = {"flash": "flash", "efficient": "mem_efficient", "cudnn": "cudnn", "math": "math"}


def set_sdpa_backends(choice: str) -> None:
    """`perf.sdpa_backend`: a pinned backend turns the others off (math included), which makes an A/B of e.g. cuDNN
    against FlashAttention on Hopper unambiguous; SDPA raises if the pinned kernel cannot run the shape. "auto"
    gives back the flags the process had before a run first pinned one: they are process-wide, and a run pinned
    to math used to leave every later run in the process (tests, a notebook) on math."""
    global _sdpa_before_pin
    cuda = torch.backends.cuda
    if choice == "auto":
        if _sdpa_before_pin is not None:
            for flag, on in _sdpa_before_pin.items():
                getattr(cuda, f"enable_{flag}_sdp")(on)
            _sdpa_before_pin = None
        return
    if _sdpa_before_pin is None:
        _sdpa_before_pin = {flag: getattr(cuda, f"{flag}_sdp_enabled")() for flag in _SDPA_FLAGS.values()}
    for flag in _SDPA_FLAGS.values():
        getattr(cuda, f"enable_{flag}_sdp")(flag == _SDPA_FLAGS[choice])


def load_data(spec: RunSpec, ctx: DistContext, cache_dir: Path, sink: MetricSink | None = None, config=None):
    """(tokenizer or None, TokenDataset), checked against the vocabulary of the model's `config`. Rank 0 builds
    the caches first (reporting its progress to `sink`), then the other ranks read them."""
    d = spec.data
    if d.corpus == RANDOM_CORPUS:  # synthetic "random" corpus: throughput benchmarks
        check_vocabulary(spec, config or model_config(spec.model, spec.vocab_size, d.seq_len), None)
        return None, TokenDataset.random(spec.vocab_size, d.seq_len, seed=0)
    for turn in ("main", "others"):
        if (turn == "main") == ctx.is_main:
            tokenizer, dataset = open_token_dataset(spec, cache_dir, sink if ctx.is_main else None, config)
        ctx.barrier()
    return tokenizer, dataset


def open_token_dataset(spec: RunSpec, cache_dir: Path, sink: MetricSink | None = None, config=None):
    """(tokenizer, TokenDataset) of a spec's data: the tokenizer `data.tokenizer` names and the cached shards
    (built when missing). Corpus errors become SpecErrors that name the file and row."""
    from training.corpus import CorpusError
    from training.tokenizer import load_tokenizer
    d = spec.data
    try:
        corpus = d.open_corpus()
        val_corpus = d.open_corpus("val_corpus") if d.val_corpus is not None else None
        path = d.tokenizer_path()
        try:
            tokenizer = load_tokenizer(str(path) if path is not None else d.tokenizer, corpus=corpus,
                                       vocab_size=d.vocab_size, cache_dir=cache_dir,
                                       init_from=spec.model.checkpoint_dir() if spec.model.source == "checkpoint"
                                       else None)
        except CorpusError:
            raise  # the corpus's own fault (a line without data.text_field, ...), found while training the tokenizer
        except ValueError as exc:  # a folder without a (fast) tokenizer: say so as the spec's error
            raise SpecError(f"data.tokenizer: {exc}") from None
        # Before tokenizing: a token id the model could not embed fails now, not after an hour of tokenizing.
        check_vocabulary(spec, config or model_config(spec.model, spec.vocab_size, spec.data.seq_len), tokenizer)
        dataset = TokenDataset.from_corpus(corpus, tokenizer, seq_len=d.seq_len, val_fraction=d.val_fraction,
                                           cache_dir=cache_dir, tokenizer_source=d.tokenizer, val_corpus=val_corpus,
                                           num_proc=d.num_proc, max_bad_fraction=d.max_bad_fraction,
                                           eos_at_split=d.eos_at_split, sink=sink)
    except CorpusError as exc:
        raise SpecError(str(exc)) from None
    dataset.info["tokenizer"] = d.tokenizer if path is None else str(path)
    dataset.info["tokenizer_vocab"] = len(tokenizer)
    return tokenizer, dataset


def _model_with_recipe(spec: RunSpec, config, device: torch.device, param_dtype: str, sink: MetricSink, *,
                       fsdp: bool = False):
    """(model, recipe report, fused_qkv, activation checkpointing, rope_backward): the seeded (or loaded) model on
    `device`, fused, converted and checkpointed as the spec asks; reports the conversion to the sink."""
    t = spec.training
    on_cuda = device.type == "cuda"
    if spec.model.source == "checkpoint":
        model = load_pretrained(spec.model.checkpoint_dir(), config, spec.seed).to(device)
    else:
        init_on = device if t.init_device == "device" else "cpu"
        model = build_model(config, spec.seed, init_on).to(device)
    llama = type(model).__name__ == "LlamaForCausalLM"
    # On a GPU a Llama's Q, K and V become one GEMM unless asked otherwise, and only where the run's keep_bf16 rules
    # keep the same layers either way (a rule naming q_proj alone matched nothing fused: the run failed at start on
    # a GPU, and trained on a CPU).
    fused_qkv = t.perf.fuse_qkv if t.perf.fuse_qkv is not None else (
        on_cuda and llama and fusing_qkv_keeps_the_rules(model, spec.keep_bf16))
    _check_llama_only(model, fuse_qkv=fused_qkv, fuse_gate_up=t.perf.fuse_gate_up)
    if fused_qkv:
        fuse_qkv(model)
    if t.perf.fuse_gate_up:
        fuse_gate_up(model)
    from training.precision import apply_recipe
    try:
        report = apply_recipe(model, spec.recipe, bf16_first_layers=spec.bf16_first_layers,
                              bf16_last_layers=spec.bf16_last_layers, keep_bf16=spec.keep_bf16, fsdp=fsdp,
                              **spec.recipe_options)
    except ValueError as exc:  # a layer count or keep_bf16 rule the model's blocks do not satisfy
        raise SpecError(str(exc)) from None
    if report.gemm_backend == "bf16" and not on_cuda and param_dtype == "fp32":
        report.gemm_backend = "fp32"  # FP32 parameters without autocast: the baseline's GEMMs are FP32 on a CPU
    sink.event("conversion_report", report=report.to_dict())
    rope_backward = set_rope_backward(model, t.perf.rope_backward, on_cuda)
    if rope_backward is None and t.perf.rope_backward == "one_pass":
        raise SpecError("training.perf.rope_backward: one_pass runs RoPE's backward on the fused QKV projection's "
                        "output, and this run has none; set training.perf.fuse_qkv to true (Llama models), or "
                        "rope_backward to auto")
    if on_cuda and t.perf.bf16_residual and param_dtype != "bf16":
        carry_residual_in_bf16(model)
    ac = apply_activation_checkpointing(model, t.activation_checkpointing, t.activation_checkpointing_every)
    model.train()
    return model, report, fused_qkv, ac, rope_backward


# Switches that rewrite Llama's own modules (the attention and MLP forwards of transformers' Llama).
LLAMA_ONLY = {"fuse_qkv": "one QKV GEMM replacing LlamaAttention's q/k/v_proj",
              "fuse_gate_up": "one gate/up GEMM replacing LlamaMLP's gate_proj and up_proj"}


def fusing_qkv_keeps_the_rules(model: torch.nn.Module, keep_bf16) -> bool:
    """Whether fusing each Llama block's q_proj, k_proj and v_proj into one qkv_proj (`fuse_qkv`) leaves what the
    keep_bf16 rules do as it is: in every block Q, K, V and the fused layer all kept or none, and every rule that
    names a layer of the unfused model still naming one."""
    keep = list(keep_bf16 or ())
    if not keep:
        return True
    fused_name = "qkv_proj"
    names, fused = [], []
    for i, block in enumerate(decoder_blocks(model)):
        for child, module in block.named_modules():
            if type(module) is torch.nn.Linear:
                full = f"layers.{i}.{child}"
                names.append(full)
                if child.rpartition(".")[2] not in QKV_NAMES:
                    fused.append(full)
        qkv = [f"layers.{i}.self_attn.{x}" for x in (*QKV_NAMES, fused_name)]
        fused.append(qkv[-1])
        if len({any(fnmatch.fnmatchcase(n, p) for p in keep) for n in qkv}) > 1:
            return False
    return all(any(fnmatch.fnmatchcase(n, p) for n in fused) for p in keep
               if any(fnmatch.fnmatchcase(n, p) for n in names))


def check_layer_choices(spec: RunSpec) -> None:
    """The run's BF16 layer choices (bf16_first_layers, bf16_last_layers, keep_bf16) against its model's blocks,
    on the model built on the meta device (no weights, no data): for the API and `plab` to refuse a typo in a
    keep_bf16 rule when the run is submitted, not when a worker starts it, maybe hours later behind a queue.
    The model's modules are named as the worker will have them: fused as training.perf.fuse_qkv / fuse_gate_up
    ask (left out, Q, K and V are fused on a GPU only where that changes nothing the rules do). A model that
    `model.config` or `model.init_from` names is read from its config.json as the worker reads it (an unreadable
    one, a data.seq_len past its max_position_embeddings, more BF16 first and last blocks than it has, fusions its
    architecture lacks are refused here too). SpecError with apply_recipe's message. A preset or custom-dims model
    without keep_bf16 rules is left alone: it imports nothing (the spec's own checks already bound its BF16 first
    and last blocks), so the API validates such specs without importing torch."""
    if not spec.keep_bf16 and spec.model.source == "preset":
        return
    from training.precision import registry

    model = meta_model(model_config(spec.model, spec.vocab_size, spec.data.seq_len))
    perf = spec.training.perf
    _check_llama_only(model, fuse_qkv=bool(perf.fuse_qkv), fuse_gate_up=perf.fuse_gate_up)
    if perf.fuse_qkv:
        fuse_qkv(model)
    if perf.fuse_gate_up:
        fuse_gate_up(model)
    try:
        registry.check_layer_choices(model, bf16_first_layers=spec.bf16_first_layers,
                                     bf16_last_layers=spec.bf16_last_layers, keep_bf16=spec.keep_bf16)
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def _check_llama_only(model: torch.nn.Module, **asked: bool) -> None:
    if type(model).__name__ == "LlamaForCausalLM":
        return
    for name, on in asked.items():
        if on:
            raise SpecError(f"training.perf.{name} ({LLAMA_ONLY[name]}) works on Llama models only, and this model "
                            f"is {type(model).__name__}; set training.perf.{name} to false (Phi-3 and GPT-NeoX "
                            f"already have fused projections of their own)")


def _optimizer(model: torch.nn.Module, spec: RunSpec, param_dtype: str, *, sharded: bool = False):
    """(trainable parameters, optimizer) with the learning rate of step 1; BF16 parameters get FP32 masters.
    Sharded (FSDP2) parameters are the FP32 masters themselves: torch's AdamW updates the shards."""
    t = spec.training
    params = [p for p in model.parameters() if p.requires_grad]
    # nanoGPT's split: decay matrices (linears, embeddings), not norms' gains.
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if sharded:
        # One fused kernel over the FP32 shards (DTensors): the multi-tensor `foreach` form makes several passes.
        optimizer = torch.optim.AdamW(groups, lr=lr_at(1, spec), betas=(t.beta1, t.beta2), fused=True)
    elif param_dtype == "bf16":
        # Masters are copied from the FP32 initial weights before the parameters are rounded to BF16;
        # only parameters are cast (buffers such as RoPE's inv_freq and recipe state stay FP32).
        optimizer = MasterAdamW(groups, lr=lr_at(1, spec), betas=(t.beta1, t.beta2), update=t.perf.optimizer_update)
        with torch.no_grad():
            for p in params:
                p.data = p.data.to(torch.bfloat16)
    else:
        # Fused AdamW (one multi-tensor kernel; CPU has a fused kernel too, so CPU and GPU runs share the
        # update rule and the clipping path of the loop).
        optimizer = torch.optim.AdamW(groups, lr=lr_at(1, spec), betas=(t.beta1, t.beta2), fused=True)
    return params, optimizer


def loss_weight_grad(t) -> str:
    """training.perf.loss_weight_grad resolved: `auto` is per_chunk where the run checkpoints activations (no tokens x
    vocab buffer beside the loss, as before one_gemm), else one_gemm."""
    if t.perf.loss_weight_grad != "auto":
        return t.perf.loss_weight_grad
    return "per_chunk" if t.activation_checkpointing != "none" else "one_gemm"


def _step_function(model, spec: RunSpec, ctx: DistContext, device: torch.device, *, compile_per_layer: bool,
                   parallel: str = "single", bf16_compute: bool = False, compile_mode: str | None = None,
                   keep_gathered: bool = False, one_rank_direct: bool = False):
    """(net, eval_net): the loss module for training steps (under DDP, or sharded by FSDP2, when several ranks
    train) and for validation, compiled as `training.compile` and `perf.compile_scope` ask. Under FSDP2 the
    blocks are compiled one by one before sharding (the sharding hooks run between them)."""
    t = spec.training
    on_cuda = device.type == "cuda"
    loss_module = CausalLMLoss(model, fused_loss=t.perf.fused_loss, chunk_tokens=t.perf.loss_chunk_tokens,
                               compute_dtype=torch.bfloat16 if on_cuda else None,
                               sync_free_mask=t.perf.sync_free_mask, weight_grad=loss_weight_grad(t))
    net = eval_net = loss_module
    if parallel == "fsdp":
        if t.compile:
            compile_layers(loss_module, t.perf.compile_mode)
        shard_model(loss_module, bf16_compute=bf16_compute, keep_gathered=keep_gathered,
                    fused_cast=t.perf.fsdp_fused_cast, one_rank_direct=one_rank_direct, accumulates=t.grad_accum > 1)
        return loss_module, loss_module
    if ctx.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP
        # Gradients live in the all-reduce buckets (no copy into and out of them each step).
        net = DDP(loss_module, device_ids=[device.index] if on_cuda else None, gradient_as_bucket_view=True,
                  bucket_cap_mb=t.perf.ddp_bucket_mb, static_graph=t.perf.ddp_static_graph)
    scope = t.perf.compile_scope if t.perf.compile_scope != "auto" else ("layers" if compile_per_layer else "model")
    if t.compile and scope == "layers":
        compile_layers(loss_module, compile_mode)
    elif t.compile:
        net = torch.compile(net, mode=compile_mode)
        eval_net = torch.compile(loss_module, mode=compile_mode)
    return net, eval_net


def _forward_buckets(model, params) -> list:
    """(module, its parameters) in the order the forward uses them: embeddings, each decoder layer, then the
    final norm with the LM head (the fused loss reads lm_head.weight right after the final norm). Anything
    else trainable joins the first bucket, so it is updated before the forward can touch it."""
    embed, blocks, head = model.get_input_embeddings(), decoder_blocks(model), model.get_output_embeddings()
    buckets = [(embed, list(embed.parameters()))]
    buckets += [(layer, list(layer.parameters())) for layer in blocks]
    # The last bucket: the decoder's parameters outside the blocks and the embeddings (its final norm, whatever
    # its name) with the head's, keyed on that norm, which runs right before the fused loss reads the head's
    # weight (the head module itself is not called then). A tied head's weight is the embeddings'.
    early = {id(p) for _, ps in buckets for p in ps}
    body = decoder_body(model)
    final = [p for p in body.parameters() if id(p) not in early]
    after = [m for m in body.children() if m is not embed and m is not blocks and any(True for _ in m.parameters())]
    buckets.append((after[-1] if after else head, final + [p for p in head.parameters() if id(p) not in early]))
    trainable = {id(p) for p in params}
    buckets = [(m, [p for p in ps if id(p) in trainable]) for m, ps in buckets]
    seen = {id(p) for _, ps in buckets for p in ps}
    buckets[0][1].extend(p for p in params if id(p) not in seen)
    return buckets
