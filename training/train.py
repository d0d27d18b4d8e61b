"""The training loop, readable top to bottom (after nanoGPT's train.py): `train(spec, sink)`.

`train` joins the processes, builds the run (`training.setup`), resumes it (`training.checkpoint.Checkpointer`),
runs `train_loop` and finishes: a last validation and checkpoint, the `TrainResult`. Per-step metrics reach
the sink through `training.metrics_drain.MetricsDrain` (no host synchronisation inside a GPU step).

Linear warm-up then cosine decay to `min_lr_ratio * lr` (`training.optim.lr_at`), global-norm gradient
clipping folded into the optimizer, gradient accumulation (in the parameters' dtype).
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from training.checkpoint import Checkpointer, TrainState, set_aside_checkpoints
from training.config import RunSpec, SpecError, plab_home
from training.data import BatchLoader
from training.flops import peak_tflops
from training.metrics_drain import MetricsDrain, StepRecord
from training.optim import clip_gradients, lr_at
from training.parallel import LocalFusedAdamW, OneRankDirectStep, clip_sharded, gradient_sync
from training.setup import Run, join_processes, setup_run
from training.sink import MetricSink, NullSink
from training.validation import ValidationLoss


@dataclass
class TrainResult:
    status: str                      # succeeded | cancelled | diverged
    steps: int                       # optimizer steps completed
    tokens: int                      # training tokens consumed (global)
    final_loss: float | None
    final_val_loss: float | None
    diverged_step: int | None
    device_name: str
    gemm_backend: str                # real | emulated | bf16 | fp32 (no converted layer, FP32 compute: a CPU's)
    conversion_report: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    checkpoint_dir: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


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
    ctx = join_processes(spec)
    sink = sink if (sink is not None and ctx.is_main) else NullSink()
    run = setup_run(spec, ctx, sink, cache_dir=Path(cache_dir) if cache_dir is not None else plab_home() / "cache")
    t = spec.training

    if not resume and output_dir is not None:
        aside = set_aside_checkpoints(output_dir) if ctx.is_main else None
        ctx.barrier()  # every rank's Checkpointer looks for the newest checkpoint after the move
        if aside is not None:
            sink.event("checkpoints_set_aside", path=str(aside))
    state = TrainState()
    drain = MetricsDrain(sink, state, device=run.device, device_name=run.device_name, lag=t.perf.metrics_lag,
                         tokens_per_step=spec.tokens_per_step, flops_per_token=run.flops_per_token, world=ctx.world)
    checkpointer = Checkpointer(output_dir, spec=spec, ctx=ctx, sink=sink, model=run.model, optimizer=run.optimizer,
                                tokenizer=run.tokenizer, hooks=run.hooks, settle=run.settle,
                                flush_metrics=drain.flush, sharded=run.sharded,
                                data_cache=run.dataset.info.get("cache"))
    if resume:  # in place: DDP and the compiled step hold these same parameters; their wrapping drew no RNG
        checkpointer.resume(state)
    start_step = state.step
    windows = run.dataset.val_windows(t.val_batches * t.batch_size, spec.data.val_windows)
    if t.val_batches > 0 and len(windows) == 0:
        # Validation was asked for and cannot happen: the run would end without the loss its verdict is judged on.
        raise SpecError(f"data: the validation split has {len(run.dataset.val)} tokens, fewer than one window of "
                        f"data.seq_len + 1 = {spec.data.seq_len + 1}; raise data.val_fraction, give a data.val_corpus, "
                        f"or lower data.seq_len (training.val_batches = 0 trains without validation)")
    validation = ValidationLoss(run.eval_net, run.model, windows,
                                micro_batch=run.micro_batch, device=run.device, ctx=ctx, autocast=run.autocast,
                                settle=run.settle)
    val_info = validation_info(run.dataset, len(windows), spec)
    sink.event("run_info", **run.info(), validation=val_info,
               device_name=run.device_name, micro_batch=run.micro_batch,
               total_steps=spec.total_steps, start_step=start_step,
               peak_bf16_tflops=peak_tflops(run.device_name, "bf16"))

    with _under_inductor_settings(run.inductor_settings):  # every compile of the step happens in here (it is lazy)
        status = train_loop(run, state, drain, checkpointer, validation, sink, should_stop)
        if status == "diverged":
            state.step = drain.diverged_step
            state.tokens = state.step * spec.tokens_per_step
        else:
            if state.step > start_step or state.val_loss is None:
                _validate(validation, state, sink)
            if checkpointer.enabled and state.step > 0 and not checkpointer.is_saved(state.step):
                checkpointer.save(state.step, state)

    summary = {**drain.summary(), **run.info(), "validation": val_info, "wall_time_s": state.wall_time()}
    report = run.report.to_dict()
    result = TrainResult(
        status=status, steps=state.step, tokens=state.tokens, final_loss=state.loss,
        final_val_loss=state.val_loss, diverged_step=drain.diverged_step, device_name=run.device_name,
        gemm_backend=getattr(run.report, "gemm_backend", "bf16"), conversion_report=list(report.get("layers", [])),
        summary=summary,
        checkpoint_dir=str(checkpointer.last_path) if checkpointer.last_path is not None else None)
    sink.event("result", **{k: v for k, v in result.to_dict().items() if k != "conversion_report"})
    return result


def validation_info(dataset, n_windows: int, spec: RunSpec) -> dict:
    """What the validation loss is the mean over: its windows, their tokens and where they lie in the split."""
    return {"windows": n_windows, "tokens": n_windows * spec.data.seq_len, "rule": spec.data.val_windows,
            "split_windows": dataset.val_window_count, "split_tokens": len(dataset.val)}


def _under_inductor_settings(settings: dict):
    """The recipe's inductor settings (Recipe.inductor_settings) for the duration of the run, inductor's own after."""
    if not settings:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(settings)


def train_loop(run: Run, state: TrainState, drain: MetricsDrain, checkpointer: Checkpointer,
               validation: ValidationLoss, sink: MetricSink, should_stop=None) -> str:
    """Steps `state.step + 1 ..` to the spec's last step; returns the status (succeeded | cancelled |
    diverged). `state.step` is then the last step completed (before a divergence is accounted for)."""
    spec, ctx, t = run.spec, run.ctx, run.spec.training
    loader = BatchLoader(run.dataset, seed=spec.seed, batch_size=t.batch_size, start_step=state.step + 1,
                         end_step=spec.total_steps, rank=ctx.rank, world=ctx.world, grad_accum=t.grad_accum,
                         device=run.device, prefetch=t.perf.prefetch)
    post_step_hooks = [h for h in run.hooks if hasattr(h, "post_optimizer_step")]
    clip = t.grad_clip if t.grad_clip > 0 else float("inf")
    gc_schedule = _GcSchedule(t.perf.gc_interval if run.on_cuda else 0)
    state.started = time.perf_counter()
    drain.start_clock(state.started)
    status = "succeeded"
    try:
        for step, micro_batches in loader:
            host_t0 = time.perf_counter()
            gc_schedule.step()
            if should_stop is not None and ctx.any_true(bool(should_stop())):
                status = "cancelled"
                break
            lr = lr_at(step, spec)
            for g in run.optimizer.param_groups:
                g["lr"] = lr
            sample_numerics = _numerics_due(run, step)
            if sample_numerics:
                run.report.set_numerics_sampling(True)

            loss_sum = _forward_backward(run, micro_batches)
            grad_norm = _clip(run, clip)
            if run.stepper is not None:
                run.stepper.step()
            else:
                run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            for hook in post_step_hooks:
                hook.post_optimizer_step(run.model)

            if sample_numerics:
                stats = run.report.collect_numerics()
                run.report.set_numerics_sampling(False)
                if stats:
                    sink.log(step, {k: float(v) for k, v in stats.items()}, tokens=state.tokens + spec.tokens_per_step,
                             wall_time=state.wall_time())

            mean_loss = loss_sum / t.grad_accum
            if ctx.enabled:
                torch.distributed.all_reduce(mean_loss, op=torch.distributed.ReduceOp.AVG)
            state.step = step
            state.tokens += spec.tokens_per_step
            now = time.perf_counter()
            wait, loader.wait_s = loader.wait_s, 0.0
            drain.push(step, mean_loss, grad_norm, StepRecord(lr=lr, tokens=state.tokens, wall=state.wall_time(now),
                                                              data_wait=wait, host_end=now, host_issue=now - host_t0))
            drain.poll()
            if drain.diverged:
                break

            last = step == spec.total_steps
            if t.val_every > 0 and step % t.val_every == 0 and not last:
                drain.flush()
                if drain.diverged:
                    break
                _validate(validation, state, sink)
                drain.restart_clock()
            if checkpointer.enabled and t.checkpoint_every > 0 and step % t.checkpoint_every == 0 and not last:
                drain.flush()
                if drain.diverged:
                    break
                checkpointer.save(step, state)
                drain.restart_clock()
        drain.flush()
    finally:
        gc_schedule.restore()
        loader.close()
        run.settle()
    return "diverged" if drain.diverged else status


def _forward_backward(run: Run, micro_batches: list[torch.Tensor]) -> torch.Tensor:
    """Forward and backward of each micro-batch, gradients summed; returns the sum of their losses (device)."""
    t = run.spec.training
    _mark_cudagraph_step(run)
    post_backward_hooks = [h for h in run.hooks if hasattr(h, "post_backward")]
    loss_sum = torch.zeros((), device=run.device)
    for i, batch in enumerate(micro_batches):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        last = i == len(micro_batches) - 1
        # Gradients are reduced across ranks only on the last micro-batch of the step.
        with gradient_sync(run.net, run.parallel, last):
            with run.autocast:
                loss = run.net(inputs, targets)
            (loss / t.grad_accum).backward()
        if not last:  # the last micro-batch's is folded by post_optimizer_step
            for hook in post_backward_hooks:
                hook.post_backward(run.model)
        loss_sum += loss.detach()
    return loss_sum


def _mark_cudagraph_step(run: Run) -> None:
    """Under inductor's CUDA graphs (compile_mode reduce-overhead) with the layers compiled one by one, the graph
    trees cannot tell where a step begins: each layer's next forward finds backwards still pending and takes the
    slow path (warning "Unable to hit fast path of CUDAGraphs because of pending, uninvoked backwards"), copying
    its inputs into the graphs' buffers. Marking each step's start lets them replay."""
    if run.on_cuda and run.spec.training.compile and run.compile_mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()


def _clip(run: Run, clip: float) -> torch.Tensor:
    """The global gradient norm (a device tensor); gradients clipped to `clip` (inf: never)."""
    if run.sharded:
        grads = run.stepper.gradients_of(run.params) if isinstance(run.stepper, OneRankDirectStep) else None
        return clip_sharded(run.params, clip, run.device, fold_into=_clip_folded_into(run), grads=grads)
    return clip_gradients(run.params, run.optimizer, clip, fused=run.spec.training.perf.fused_clip, device=run.device)


def _clip_folded_into(run: Run):
    """The sharded update that divides the gradients by the clipping factor as it reads them (FSDP2's overlapped
    step, whose fused AdamW takes a `grad_scale`), when `perf.fused_clip` asks for it; None otherwise. FSDP2's
    one-rank direct step always divides as it reads: its BF16 gradients cannot be divided in place without a
    rounding FSDP2's FP32 gradients do not have."""
    update = getattr(run.stepper, "update", None)
    if not isinstance(update, LocalFusedAdamW):
        return None
    return update if run.spec.training.perf.fused_clip or isinstance(run.stepper, OneRankDirectStep) else None


def _numerics_due(run: Run, step: int) -> bool:
    """Whether step `step` samples the recipe's numerics statistics (`training.numerics_every`)."""
    every = run.spec.training.numerics_every
    can_sample = hasattr(run.report, "set_numerics_sampling") and hasattr(run.report, "collect_numerics")
    return can_sample and every > 0 and step % every == 0


def _validate(validation: ValidationLoss, state: TrainState, sink: MetricSink) -> None:
    """Validation loss into `state.val_loss`, logged at `state.step`."""
    state.val_loss = validation.loss()
    if state.val_loss is not None:
        sink.log(state.step, {"val/loss": state.val_loss}, tokens=state.tokens, wall_time=state.wall_time())


class _GcSchedule:
    """Python's cyclic GC, left automatic, runs full collections at moments set by allocation counts; over the
    many objects a compiled model keeps alive one takes tens of ms, during which no kernel is issued and the
    GPU idles. With an interval N > 0, what exists after the first step is frozen out of collections and the
    collector runs every N steps instead (Megatron's --manual-gc). 0 leaves the collector alone."""

    def __init__(self, interval: int):
        self.interval = interval
        self.steps = 0
        self.was_enabled = gc.isenabled()

    def step(self) -> None:
        """At the start of each step."""
        self.steps += 1
        if self.interval <= 0:
            return
        if self.steps == 2:
            gc.collect()
            gc.freeze()
            gc.disable()
        elif self.steps > 2 and self.steps % self.interval == 0:
            gc.collect()

    def restore(self) -> None:
        if self.interval > 0:
            gc.unfreeze()
            if self.was_enabled:
                gc.enable()
