"""The training loop: one function, `train(spec, sink)`, readable top to bottom (after nanoGPT's train.py).

Numerics: FP32 master weights always. `training.param_dtype` "bf16" (the GPU default): the model's
parameters are BF16 and compute in BF16 (recipes replace the GEMMs of converted linears), the optimizer
(training.optim.MasterAdamW) keeps FP32 masters and moments and writes the rounded weights back after
each step. "fp32" (the CPU default): FP32 parameters, forward/backward under BF16 autocast on GPU, plain
FP32 on CPU, torch's fused AdamW. Linear warm-up then cosine decay to `min_lr_ratio * lr`, global-norm
gradient clipping folded into the optimizer, gradient accumulation (in the parameters' dtype).

No host synchronisation inside a GPU step: the loss and grad norm of step s are copied to pinned host
memory with `non_blocking=True` behind a CUDA event and read `perf.metrics_lag` steps later; step time is
measured between CUDA events. A NaN/Inf loss is therefore noticed a few steps late on GPU, but the
reported `diverged_step` is the step whose loss was non-finite.
"""
from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from training import checkpoint as ckpt
from training.config import RunSpec, SpecError, plab_home
from training.data import BatchLoader, TokenDataset
from training.distributed import DistContext, init_distributed
from training.flops import flops_per_token, mfu, peak_tflops
from training.optim import MasterAdamW, OverlappedOptimizerStep
from training.model import (CausalLMLoss, build_model, carry_residual_in_bf16, compile_layers, count_parameters,
                            fuse_gate_up, fuse_qkv, llama_config)
from training.sink import MetricSink, NullSink


@dataclass
class TrainResult:
    status: str                      # succeeded | cancelled | diverged
    steps: int                       # optimizer steps completed
    tokens: int                      # training tokens consumed (global)
    final_loss: float | None
    final_val_loss: float | None
    diverged_step: int | None
    device_name: str
    gemm_backend: str                # real | emulated | bf16
    conversion_report: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    checkpoint_dir: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def lr_at(step: int, spec: RunSpec) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warm-up, then cosine to min_lr_ratio·lr."""
    t = spec.training
    total = spec.total_steps
    if t.warmup_steps > 0 and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    decay_steps = max(total - t.warmup_steps, 1)
    progress = min(max(step - t.warmup_steps, 0) / decay_steps, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine)


def _resolve_device(requested: str, ctx: DistContext) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SpecError(f"training.device is {requested!r} but no CUDA GPU is visible; use 'auto' or 'cpu'")
        if requested == "cuda":
            return torch.device("cuda", ctx.local_rank if ctx.enabled else torch.cuda.current_device())
    return torch.device(requested)


def _configure_backends(device: torch.device, perf) -> None:
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = perf.allow_tf32
    torch.backends.cudnn.allow_tf32 = perf.allow_tf32
    if perf.sdpa_backend != "auto":
        # Pinning one backend (and turning the others off, math included) makes an A/B of e.g. cuDNN vs
        # FlashAttention on Hopper unambiguous; it raises if the pinned kernel cannot run the shape.
        b = perf.sdpa_backend
        torch.backends.cuda.enable_flash_sdp(b == "flash")
        torch.backends.cuda.enable_mem_efficient_sdp(b == "efficient")
        torch.backends.cuda.enable_cudnn_sdp(b == "cudnn")
        torch.backends.cuda.enable_math_sdp(b == "math")


def _load_data(spec: RunSpec, ctx: DistContext, cache_dir: Path):
    """(tokenizer or None, TokenDataset). Rank 0 builds the caches first so ranks never race."""
    from training.tokenizer import get_tokenizer
    d = spec.data
    corpus = d.corpus_dir()
    if corpus is None:  # synthetic "random" corpus: throughput benchmarks
        return None, TokenDataset.random(spec.vocab_size, d.seq_len, seed=0)
    for turn in ("main", "others"):
        if (turn == "main") == ctx.is_main:
            tokenizer = get_tokenizer(corpus, d.vocab_size, cache_dir)
            dataset = TokenDataset.from_corpus(corpus, tokenizer, seq_len=d.seq_len,
                                               val_fraction=d.val_fraction, cache_dir=cache_dir)
        ctx.barrier()
    return tokenizer, dataset


class _AsyncScalars:
    """Device scalars of a step, copied to pinned host memory without blocking; read later."""

    def __init__(self, device: torch.device, lag: int):
        self.device, self.lag = device, lag
        self.cuda = device.type == "cuda"
        self.pending: deque = deque()

    def push(self, step: int, values: torch.Tensor, info: dict) -> None:
        if self.cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pending.append((step, host, event, info))
        else:
            self.pending.append((step, values, None, info))

    def ready(self, flush: bool = False):
        """Yield (step, host values, end event, info) for steps that are done or older than `lag`."""
        while self.pending:
            step, host, event, info = self.pending[0]
            if not (flush or not self.cuda or len(self.pending) > self.lag or event.query()):
                return
            self.pending.popleft()
            if event is not None:
                event.synchronize()
            yield step, host.tolist(), event, info


def train(spec: RunSpec | dict, sink: MetricSink | None = None, *, should_stop=None, output_dir=None,
          resume: bool = True, cache_dir=None) -> TrainResult:
    """Train one run. See docs/INTERFACES.md for the contract (statuses, metric keys, TrainResult)."""
    if isinstance(spec, dict):
        spec = RunSpec.from_dict(spec)
    if not isinstance(spec, RunSpec):
        raise TypeError(f"spec must be a RunSpec or a run-spec dict, got {type(spec).__name__}")
    if should_stop is not None and not callable(should_stop):
        raise TypeError(f"should_stop must be a callable returning bool (e.g. threading.Event().is_set), "
                        f"got {type(should_stop).__name__}")
    t = spec.training
    cache_dir = Path(cache_dir) if cache_dir is not None else plab_home() / "cache"

    # ---- processes, device --------------------------------------------------------------------
    requested_kind = "cuda" if (t.device.startswith("cuda") or (t.device == "auto" and torch.cuda.is_available())) else "cpu"
    ctx = init_distributed(requested_kind)
    if ctx.world != 1 and ctx.world != t.gpus:
        raise SpecError(f"the spec asks for training.gpus={t.gpus} but {ctx.world} processes were launched; "
                        f"launch with torchrun --nproc-per-node {t.gpus}")
    if ctx.world == 1 and t.gpus > 1:
        raise SpecError(f"training.gpus={t.gpus} needs one process per GPU: launch with "
                        f"`torchrun --nproc-per-node {t.gpus} -m training.distributed SPEC.json --output-dir DIR`")
    sink = sink if (sink is not None and ctx.is_main) else NullSink()
    device = _resolve_device(t.device, ctx)
    _configure_backends(device, t.perf)
    on_cuda = device.type == "cuda"
    device_name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    param_dtype = t.param_dtype if t.param_dtype != "auto" else ("bf16" if on_cuda else "fp32")
    bf16_params = param_dtype == "bf16"
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if on_cuda and not bf16_params
                else contextlib.nullcontext())

    # ---- data, model, recipe ------------------------------------------------------------------
    tokenizer, dataset = _load_data(spec, ctx, cache_dir)
    vocab = spec.vocab_size
    if tokenizer is not None and len(tokenizer) > vocab:
        raise SpecError(f"the tokenizer has {len(tokenizer)} tokens but the model only {vocab}; raise "
                        f"model.vocab_size or lower data.vocab_size")
    config = llama_config(spec.model, vocab, spec.data.seq_len)
    model = build_model(config, spec.seed).to(device)
    fused_qkv = t.perf.fuse_qkv if t.perf.fuse_qkv is not None else on_cuda
    if fused_qkv:
        fuse_qkv(model)
    if t.perf.fuse_gate_up:
        fuse_gate_up(model)
    from training.precision import apply_recipe
    report = apply_recipe(model, spec.recipe, bf16_first_layers=spec.bf16_first_layers,
                          bf16_last_layers=spec.bf16_last_layers, **spec.recipe_options)
    report_dict = report.to_dict()
    sink.event("conversion_report", report=report_dict)
    hooks = list(getattr(report, "hooks", []) or [])
    post_step_hooks = [h for h in hooks if hasattr(h, "post_optimizer_step")]
    post_backward_hooks = [h for h in hooks if hasattr(h, "post_backward")]
    can_sample_numerics = hasattr(report, "set_numerics_sampling") and hasattr(report, "collect_numerics")
    if on_cuda and t.perf.bf16_residual and not bf16_params:
        carry_residual_in_bf16(model)
    if t.activation_checkpointing:
        # transformers >= 5.x renamed the API; the GPU images may carry an older release.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    params = [p for p in model.parameters() if p.requires_grad]
    # nanoGPT's split: decay matrices (linears, embeddings), not norms' gains.
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if bf16_params:
        # Masters are copied from the FP32 initial weights before the parameters are rounded to BF16;
        # only parameters are cast (buffers such as RoPE's inv_freq and recipe state stay FP32).
        optimizer = MasterAdamW(groups, lr=lr_at(1, spec), betas=(t.beta1, t.beta2))
        with torch.no_grad():
            for p in params:
                p.data = p.data.to(torch.bfloat16)
    else:
        # Fused AdamW (one multi-tensor kernel; CPU has a fused kernel too, so CPU and GPU runs share the
        # update rule and the clipping path below).
        optimizer = torch.optim.AdamW(groups, lr=lr_at(1, spec), betas=(t.beta1, t.beta2), fused=True)

    # ---- resume -------------------------------------------------------------------------------
    start_step, tokens_seen, wall_offset = 0, 0, 0.0
    last_loss = last_val = None
    # Randomness inside the step (NVFP4's stochastic rounding of gradients) draws from the global generators:
    # seed them from the run's seed and rank so the same spec reproduces the same run; a resume below restores
    # their exact state from the checkpoint instead.
    torch.manual_seed(spec.seed * 1_000_003 + ctx.rank)
    if resume and output_dir is not None and (latest := ckpt.latest_checkpoint(output_dir)) is not None:
        state = ckpt.load_checkpoint(latest, model=model, optimizer=optimizer, hooks=hooks)
        if state.get("spec") is not None and _numerics_identity(state["spec"]) != _numerics_identity(spec.to_dict()):
            raise SpecError(f"checkpoint {latest} was written by a different run spec; use another "
                            f"output_dir or resume=False")
        start_step, tokens_seen = state["step"], state["tokens"]
        wall_offset, last_loss, last_val = state.get("wall_time", 0.0), state.get("loss"), state.get("val_loss")
        sink.event("resumed", step=start_step, path=str(latest))

    # ---- the step function: model + loss, under DDP and torch.compile as asked ----------------
    loss_module = CausalLMLoss(model, fused_loss=t.perf.fused_loss, chunk_tokens=t.perf.loss_chunk_tokens,
                               compute_dtype=torch.bfloat16 if on_cuda else None)
    net = loss_module
    if ctx.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP
        # Gradients live in the all-reduce buckets (no copy into and out of them each step).
        net = DDP(loss_module, device_ids=[device.index] if on_cuda else None, gradient_as_bucket_view=True,
                  bucket_cap_mb=t.perf.ddp_bucket_mb, static_graph=t.perf.ddp_static_graph)
    eval_net = loss_module
    overlap = on_cuda and bf16_params and t.perf.overlap_optimizer
    scope = t.perf.compile_scope if t.perf.compile_scope != "auto" else ("layers" if overlap else "model")
    if t.compile and scope == "layers":
        compile_layers(loss_module, t.perf.compile_mode)
    elif t.compile:
        net = torch.compile(net, mode=t.perf.compile_mode)
        eval_net = torch.compile(loss_module, mode=t.perf.compile_mode)
    stepper = OverlappedOptimizerStep(optimizer, _forward_buckets(model, params)) if overlap else None

    def optimizer_settled() -> None:
        """Before anything reads the weights or optimizer state outside the forward (validation,
        checkpoints, the end): the compute stream waits for the overlapped update to finish."""
        if stepper is not None:
            stepper.synchronize()

    total_steps = spec.total_steps
    tokens_per_step = spec.tokens_per_step
    fpt = flops_per_token(config, spec.data.seq_len)
    micro_batch = t.batch_size // (t.grad_accum * ctx.world)
    val_windows = dataset.val_windows(t.val_batches * t.batch_size)
    sink.event("run_info", params=count_parameters(model), flops_per_token=fpt, device_name=device_name,
               param_dtype=param_dtype, fused_qkv=fused_qkv, fused_gate_up=t.perf.fuse_gate_up,
               overlap_optimizer=overlap, world_size=ctx.world, micro_batch=micro_batch, total_steps=total_steps,
               start_step=start_step, peak_bf16_tflops=peak_tflops(device_name, "bf16"))

    def evaluate() -> float | None:
        """Mean loss over the fixed validation windows (split over ranks, summed back)."""
        if len(val_windows) == 0:
            return None
        mine = val_windows[ctx.rank::ctx.world]
        optimizer_settled()
        total = torch.zeros(2, dtype=torch.float64, device=device)
        model.eval()
        with torch.no_grad():
            for chunk in mine.split(micro_batch):
                chunk = chunk.to(device, non_blocking=True)
                with autocast:
                    loss = eval_net(chunk[:, :-1], chunk[:, 1:])
                total[0] += loss.double() * len(chunk)
                total[1] += len(chunk)
        model.train()
        if ctx.enabled:
            torch.distributed.all_reduce(total)
        return (total[0] / total[1]).item()

    def save(step: int) -> Path:
        optimizer_settled()
        pending_flush()  # metrics up to `step` reach the sink before the checkpoint claims them done
        sink.flush()  # ...and are durable there: a resume from this checkpoint never re-logs or loses a step
        path = None
        if ctx.is_main:
            path = ckpt.save_checkpoint(
                output_dir, step, model=model, optimizer=optimizer, tokenizer=tokenizer, hooks=hooks,
                extra={"tokens": tokens_seen, "wall_time": wall_offset + time.perf_counter() - t_start,
                       "loss": last_loss, "val_loss": last_val, "spec": spec.to_dict()})
            sink.event("checkpoint", step=step, path=str(path))
        ctx.barrier()
        return path

    # ---- the loop -----------------------------------------------------------------------------
    status, diverged_step = "succeeded", None
    step_times, data_waits, checkpoint_path = [], [], None
    if output_dir is not None and (latest := ckpt.latest_checkpoint(output_dir)) is not None:
        checkpoint_path = latest
    scalars = _AsyncScalars(device, t.perf.metrics_lag)
    loader = BatchLoader(dataset, seed=spec.seed, batch_size=t.batch_size, start_step=start_step + 1,
                         end_step=total_steps, rank=ctx.rank, world=ctx.world, grad_accum=t.grad_accum,
                         device=device, prefetch=t.perf.prefetch)
    clip = t.grad_clip if t.grad_clip > 0 else float("inf")
    t_start = time.perf_counter()
    prev_end = {"event": None, "host": t_start}
    if on_cuda:
        prev_end["event"] = torch.cuda.Event(enable_timing=True)
        prev_end["event"].record()
        torch.cuda.reset_peak_memory_stats(device)

    def drain(flush: bool = False) -> None:
        """Log every step whose scalars are on the host; stop at the first non-finite loss."""
        nonlocal status, diverged_step, last_loss
        for step, (loss, grad_norm), end_event, info in scalars.ready(flush):
            if status == "diverged":
                continue
            if end_event is not None:
                step_s = prev_end["event"].elapsed_time(end_event) / 1000.0
                prev_end["event"] = end_event
            else:
                step_s = info["host_end"] - prev_end["host"]
                prev_end["host"] = info["host_end"]
            if not math.isfinite(loss):
                status, diverged_step = "diverged", step
                sink.log(step, {"train/loss": loss}, tokens=info["tokens"], wall_time=info["wall"])
                continue
            last_loss = loss
            tok_s = tokens_per_step / step_s if step_s > 0 else float("nan")
            metrics = {"train/loss": loss, "train/lr": info["lr"], "train/grad_norm": grad_norm,
                       "perf/tokens_per_s": tok_s, "perf/step_time_s": step_s,
                       "perf/data_wait_s": info["data_wait"], "perf/tflops": fpt * tok_s / 1e12,
                       # host time to issue the step (loader wait excluded); near step_time_s = launch-bound
                       "perf/host_issue_s": info.get("host_issue", 0.0)}
            m = mfu(fpt, tok_s, device_name=device_name, n_gpus=ctx.world)
            if m is not None:
                metrics["perf/mfu"] = m
            if on_cuda:
                metrics["perf/peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            step_times.append(step_s)
            data_waits.append(info["data_wait"])
            sink.log(step, metrics, tokens=info["tokens"], wall_time=info["wall"])

    def pending_flush():
        drain(flush=True)

    def restart_step_clock():
        """After validation or a checkpoint, so that their time is not booked to the next step."""
        if on_cuda:
            prev_end["event"] = torch.cuda.Event(enable_timing=True)
            prev_end["event"].record()
        else:
            prev_end["host"] = time.perf_counter()

    def clip_gradients() -> torch.Tensor:
        """Global gradient norm (a device tensor: no sync); clips to `grad_clip` when set."""
        if not t.perf.fused_clip:
            return torch.nn.utils.clip_grad_norm_(params, clip)
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=device)
        # Per-tensor norms in FP32 (BF16 gradients would otherwise give BF16-rounded norms).
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
        # The fused AdamW kernel divides every gradient by `grad_scale` as it reads it: the same
        # min(1, clip / (norm + 1e-6)) factor as clip_grad_norm_, without its in-place pass.
        optimizer.grad_scale = (torch.clamp((norm.float() + 1e-6) / clip, min=1.0)
                                if math.isfinite(clip) else None)
        return norm

    step = start_step
    # Python's cyclic GC, left automatic, runs full collections at moments set by allocation counts; over the
    # many objects a compiled model keeps alive one takes tens of ms, during which no kernel is issued and the
    # GPU idles. With `gc_interval` N > 0 (GPU runs), what exists after the first step is frozen out of
    # collections and the collector runs every N steps instead (Megatron's --manual-gc).
    manual_gc = on_cuda and t.perf.gc_interval > 0
    gc_was_enabled = gc.isenabled()
    steps_run = 0
    try:
        for step, micro_batches in loader:
            host_t0 = time.perf_counter()
            steps_run += 1
            if manual_gc and steps_run == 2:
                gc.collect()
                gc.freeze()
                gc.disable()
            elif manual_gc and steps_run > 2 and steps_run % t.perf.gc_interval == 0:
                gc.collect()
            if should_stop is not None and ctx.any_true(bool(should_stop())):
                status = "cancelled"
                step -= 1
                break
            lr = lr_at(step, spec)
            for g in optimizer.param_groups:
                g["lr"] = lr
            sample_numerics = can_sample_numerics and t.numerics_every > 0 and step % t.numerics_every == 0
            if sample_numerics:
                report.set_numerics_sampling(True)

            loss_sum = torch.zeros((), device=device)
            for i, batch in enumerate(micro_batches):
                inputs, targets = batch[:, :-1], batch[:, 1:]
                # DDP all-reduces gradients only on the last micro-batch of the step.
                sync = (contextlib.nullcontext() if not ctx.enabled or i == len(micro_batches) - 1
                        else net.no_sync())
                with sync:
                    with autocast:
                        loss = net(inputs, targets)
                    (loss / t.grad_accum).backward()
                if i < len(micro_batches) - 1:  # the last micro-batch's is folded by post_optimizer_step
                    for hook in post_backward_hooks:
                        hook.post_backward(model)
                loss_sum += loss.detach()
            grad_norm = clip_gradients()
            if stepper is not None:
                stepper.step()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for hook in post_step_hooks:
                hook.post_optimizer_step(model)

            if sample_numerics:
                stats = report.collect_numerics()
                report.set_numerics_sampling(False)
                if stats:
                    sink.log(step, {k: float(v) for k, v in stats.items()}, tokens=tokens_seen + tokens_per_step,
                             wall_time=wall_offset + time.perf_counter() - t_start)

            mean_loss = loss_sum / t.grad_accum
            if ctx.enabled:
                torch.distributed.all_reduce(mean_loss, op=torch.distributed.ReduceOp.AVG)
            tokens_seen += tokens_per_step
            now = time.perf_counter()
            wait = loader.wait_s
            loader.wait_s = 0.0
            scalars.push(step, torch.stack([mean_loss.float(), grad_norm.float().reshape(())]),
                         {"lr": lr, "tokens": tokens_seen, "wall": wall_offset + now - t_start,
                          "data_wait": wait, "host_end": now, "host_issue": now - host_t0})
            drain()
            if status == "diverged":
                break

            if t.val_every > 0 and step % t.val_every == 0 and step != total_steps:
                drain(flush=True)
                if status == "diverged":
                    break
                last_val = evaluate()
                if last_val is not None:
                    sink.log(step, {"val/loss": last_val}, tokens=tokens_seen,
                             wall_time=wall_offset + time.perf_counter() - t_start)
                restart_step_clock()
            if output_dir is not None and t.checkpoint_every > 0 and step % t.checkpoint_every == 0 \
                    and step != total_steps:
                drain(flush=True)
                if status == "diverged":
                    break
                checkpoint_path = save(step)
                restart_step_clock()
        drain(flush=True)
    finally:
        if manual_gc:
            gc.unfreeze()
            if gc_was_enabled:
                gc.enable()
        loader.close()
        optimizer_settled()

    steps_done = diverged_step if status == "diverged" else step
    if status == "diverged":
        tokens_seen = steps_done * tokens_per_step
    else:
        if steps_done > start_step or last_val is None:
            last_val = evaluate()
            if last_val is not None:
                sink.log(steps_done, {"val/loss": last_val}, tokens=tokens_seen,
                         wall_time=wall_offset + time.perf_counter() - t_start)
        if output_dir is not None and steps_done > 0 and (
                checkpoint_path is None or not str(checkpoint_path).endswith(f"step_{steps_done:08d}")):
            checkpoint_path = save(steps_done)

    summary = _summary(step_times, data_waits, tokens_per_step, fpt, device_name, ctx.world,
                       device if on_cuda else None)
    summary.update(params=count_parameters(model), flops_per_token=fpt, world_size=ctx.world,
                   param_dtype=param_dtype, fused_qkv=fused_qkv, fused_gate_up=t.perf.fuse_gate_up,
                   overlap_optimizer=overlap, wall_time_s=wall_offset + time.perf_counter() - t_start)
    result = TrainResult(
        status=status, steps=steps_done, tokens=tokens_seen, final_loss=last_loss,
        final_val_loss=last_val, diverged_step=diverged_step, device_name=device_name,
        gemm_backend=getattr(report, "gemm_backend", "bf16"),
        conversion_report=list(report_dict.get("layers", [])), summary=summary,
        checkpoint_dir=str(checkpoint_path) if checkpoint_path is not None else None)
    sink.event("result", **{k: v for k, v in result.to_dict().items() if k != "conversion_report"})
    return result


def _forward_buckets(model, params) -> list:
    """(module, its parameters) in the order the forward uses them: embeddings, each decoder layer, then the
    final norm with the LM head (the fused loss reads lm_head.weight right after the final norm). Anything
    else trainable joins the first bucket, so it is updated before the forward can touch it."""
    inner = model.model
    buckets = [(inner.embed_tokens, list(inner.embed_tokens.parameters()))]
    buckets += [(layer, list(layer.parameters())) for layer in inner.layers]
    buckets.append((inner.norm, list(inner.norm.parameters()) + list(model.lm_head.parameters())))
    trainable = {id(p) for p in params}
    buckets = [(m, [p for p in ps if id(p) in trainable]) for m, ps in buckets]
    seen = {id(p) for _, ps in buckets for p in ps}
    buckets[0][1].extend(p for p in params if id(p) not in seen)
    return buckets


def _numerics_identity(spec_dict: dict) -> dict:
    """The parts of a spec that decide the numbers a run produces (not how fast or where it runs)."""
    d = {k: v for k, v in spec_dict.items() if k != "training"}
    d["training"] = {k: v for k, v in spec_dict["training"].items()
                     if k not in ("perf", "device", "gpus", "compile", "checkpoint_every")}
    # A fused QKV projection changes the parameter list (and a recipe's scaling of it).
    d["training"]["perf.fuse_qkv"] = (spec_dict["training"].get("perf") or {}).get("fuse_qkv")
    d["training"]["perf.fuse_gate_up"] = bool((spec_dict["training"].get("perf") or {}).get("fuse_gate_up"))
    return d


def _summary(step_times, data_waits, tokens_per_step, fpt, device_name, world, cuda_device) -> dict:
    """Steady-state figures: medians over steps, skipping the first two (compile, allocator warm-up)."""
    times = step_times[2:] if len(step_times) > 4 else step_times
    if not times:
        return {}
    step_s = statistics.median(times)
    tok_s = tokens_per_step / step_s
    out = {"tokens_per_s": tok_s, "step_time_s": step_s, "tflops": fpt * tok_s / 1e12,
           "data_wait_share": sum(data_waits[-len(times):]) / sum(times),
           "mfu": mfu(fpt, tok_s, device_name=device_name, n_gpus=world)}
    if cuda_device is not None:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(cuda_device) / 2**30
    return out
