"""How the ranks share the model: DDP (every rank holds everything) or FSDP2 (`fully_shard`: every rank holds
1/N of the weights, gradients and optimizer state), and activation checkpointing.

`training.parallel`:
- "ddp": one full copy of the training state per GPU, gradients all-reduced (training.setup's DDP wrap).
- "fsdp": `torch.distributed.fsdp.fully_shard` on every decoder block, then on the loss module as the root
  (embeddings, final norm and LM head are its own parameters: the fused loss reads `lm_head.weight` directly,
  so the root must be the module whose forward runs it). Parameters stay FP32 on their shards - they are the
  master weights - and with `param_dtype` "bf16" a `MixedPrecisionPolicy` all-gathers them in BF16 for
  compute and reduce-scatters gradients in FP32; the optimizer (torch's AdamW) updates the FP32 shards.
  torchao's tensorwise float8 linears all-gather their weights in FP8 (`enable_fsdp_float8_all_gather`)
  with one scale pass for all of them after each optimizer step (the recipe's hook); fp8_delayed takes the
  max of its amaxes over ranks (as under DDP); the emulated formats quantize the unsharded weight, which
  FSDP2 has gathered before the block's forward, exactly as on one GPU. On one process, where nothing is gathered
  or reduced, `OneRankDirectStep` keeps the BF16 weights and gradients from step to step (`perf.fsdp_one_rank_direct`).
- "auto": FSDP when several processes train and the training state (16 bytes per parameter: FP32 master,
  gradient, two moments) would take more than half of one GPU's memory; DDP otherwise.

`training.activation_checkpointing` (what the backward recomputes instead of keeping):
- "none"; "full": every decoder block's activations are recomputed; "blocks": every k-th block
  (`training.activation_checkpointing_every`, the last of each group of k); "ops": every block, but the
  outputs of its matmuls and attention are kept (selective per-op, torchtitan's policy without its
  every-other-matmul rule), so only norms, RoPE and elementwise work is redone.
The wrap keeps the module tree and parameter names (the block's `forward` is replaced, not the block), so
checkpoints and the recipes' layer names are the same with and without it.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from training import optim_kernels
from training.optim import SideStreamStep

PARALLEL_MODES = ("auto", "ddp", "fsdp")
AC_MODES = ("none", "full", "blocks", "ops")
STATE_BYTES_PER_PARAM = 16  # FP32 master + FP32 gradient + FP32 m and v
AUTO_FSDP_SHARE = 0.5       # "auto" shards when the training state would take more than this share of a GPU


def resolve_parallel(requested: str, world: int, n_params: int, device: torch.device) -> str:
    """"single", "ddp" or "fsdp" for `training.parallel` = `requested` on `world` processes. One process runs
    FSDP2 only when asked by name (a one-rank group: the same code path as on N GPUs, to measure its overhead);
    "auto" and "ddp" leave it unwrapped."""
    if world <= 1:
        return "fsdp" if requested == "fsdp" else "single"
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "ddp"
    total = torch.cuda.get_device_properties(device).total_memory
    return "fsdp" if n_params * STATE_BYTES_PER_PARAM > AUTO_FSDP_SHARE * total else "ddp"


def shard_model(loss_module: torch.nn.Module, *, bf16_compute: bool, keep_gathered: bool,
                fused_cast: bool = True, one_rank_direct: bool = False, accumulates: bool = False) -> bool:
    """FSDP2 in place: each decoder block, then the loss module (root). `bf16_compute`: all-gather the FP32
    shards as BF16 and reduce-scatter gradients in FP32; otherwise everything stays FP32. `keep_gathered`: the
    blocks keep their gathered weights from the forward to the backward (`keeps_gathered_weights`). `fused_cast`:
    on one rank, each unshard casts the shards straight into the unsharded parameters (`one_rank_cast_into_output`).
    `one_rank_direct`: on one rank, and where `one_rank_direct_applies`, the units keep their unsharded parameters
    and gradients from step to step for `OneRankDirectStep` (`accumulates`: the steps sum several micro-batches'
    gradients, which then add up in FP32 as FSDP2's reduce dtype asks; with one micro-batch nothing is summed and
    the BF16 gradients stay as they are). Returns whether the direct path was set up."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import torch.distributed as dist

    from training.model import decoder_blocks
    direct = one_rank_direct and dist.get_world_size() == 1 and one_rank_direct_applies(loss_module)
    reduce_dtype = torch.bfloat16 if direct and not accumulates else torch.float32
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) if bf16_compute
          else MixedPrecisionPolicy())
    layers = list(decoder_blocks(loss_module.model))
    for i, layer in enumerate(layers):
        # The last block's weights are needed again at once by the backward: keep them gathered (torchtitan).
        fully_shard(layer, mp_policy=mp, reshard_after_forward=(not keep_gathered and not direct
                                                                and i < len(layers) - 1))
    fully_shard(loss_module, mp_policy=mp, reshard_after_forward=not direct)
    if dist.get_world_size() == 1:
        for unit in [*layers, loss_module]:
            unit.set_custom_reduce_scatter(OneRankReduceScatter())
            if fused_cast:
                one_rank_cast_into_output(unit)
    if direct:
        # No reduction ever (FSDP2's gradient sync stays off: `gradient_sync`), and nothing freed after the backward.
        loss_module.set_requires_gradient_sync(False)
        loss_module.set_reshard_after_backward(False)
        loss_module._plab_one_rank_direct = True
    return direct


def one_rank_direct_applies(module: torch.nn.Module) -> bool:
    """Whether `OneRankDirectStep` can take a one-rank FSDP2 run of `module` (before sharding): plain parameters.
    torchao's FP8 all-gather weights bring their own pre-all-gather cast and a scale pass after each step that
    expects the sharded parameters; they keep FSDP2's path."""
    return all(type(p.data) is torch.Tensor and not hasattr(p, "fsdp_pre_all_gather") for p in module.parameters())


def keeps_gathered_weights(module: torch.nn.Module, world: int, policy: str = "auto") -> bool:
    """Whether FSDP2's blocks keep their gathered weights from the forward to the backward instead of gathering
    (and, with FP8 all-gather, casting) them twice. "auto": one process, which has no peers to shard across, keeps
    them unless its BF16 copies would take a tenth of the GPU; several processes keep them on a GPU where they take
    less than that (one of each block's gathers per step instead of two: a 1.14B model on 4 GPUs has 2.3 GB of
    them), and free them on a CPU (torch's default, the path large models take)."""
    if policy != "auto":
        return policy == "never"
    on_cuda = next(module.parameters()).device.type == "cuda"
    return _bf16_copy_is_small(module) if (world == 1 or on_cuda) else False


class OneRankReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter on a one-rank group, without its copy. FSDP2 packs a unit's gradients into a
    reduce-scatter input buffer (cast to the reduce dtype), allocates an output buffer of the same size, and
    with one rank copies the one into the other (`reduce_output.copy_(reduce_scatter_input)`): a device-to-device
    copy of every FP32 gradient, 8 B per parameter, 8.3 ms per 1.14B step on an H100 as a copy-engine memcpy
    (bench/results/step_profile_2026-11-25T0020_*). Here the output allocation returns the input buffer itself
    (`allocate` is called for the input, then for the output, in that order, by `foreach_reduce`), so the copy
    is a no-op (`copy_` of a tensor onto itself returns at once) and the sharded gradients are views of the one
    buffer: the same values, one FP32 gradient buffer fewer in flight. Installed only on one-rank groups;
    FSDP2 never calls the comm itself there, and `__call__` refuses a group of several ranks."""

    def __init__(self):
        self._input: torch.Tensor | None = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        pending, self._input = self._input, None
        if pending is not None:  # the output: the input just packed (one rank: the same size)
            if pending.dtype != dtype or pending.shape != torch.Size(size):
                raise RuntimeError("FSDP2 asked for a reduce-scatter output unlike its input on a one-rank group")
            return pending
        self._input = torch.empty(*size, dtype=dtype, device=device)
        return self._input

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if group.size() != 1:
            raise RuntimeError("OneRankReduceScatter is for one-rank groups only")
        if output_tensor.data_ptr() != input_tensor.data_ptr():
            output_tensor.copy_(input_tensor)
        return None


def one_rank_cast_into_output(unit: torch.nn.Module) -> int:
    """FSDP2's one-rank unshard in one pass: the FP32 shard cast straight into the BF16 unsharded parameter's
    storage. On a one-rank group `FSDPParamGroup.wait_for_unshard` reads `FSDPParam.all_gather_inputs` (the shard
    cast to BF16 into a new tensor: 6 B per parameter) and copies that into `all_gather_outputs[0]`, the unsharded
    parameter's storage (4 B more, a Memcpy DtoD). Here, once FSDP2 has made that output (the first unshard takes
    its own path), `all_gather_inputs` casts into the output itself and returns it, and FSDP2's copy of a tensor
    onto itself returns at once: the same bits, 6 B per parameter instead of 10. Only for plain tensors with a
    mixed-precision cast, not offloaded: a parameter whose tensor subclass brings its own pre-all-gather (torchao's
    FP8 all-gather) or anything unexpected keeps FSDP2's path. Returns the number of parameters marked (0 where
    this torch's FSDP2 lacks the internals it relies on)."""
    try:
        params = unit._get_fsdp_state()._fsdp_param_group.fsdp_params
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except (AttributeError, ImportError):
        return 0
    if not isinstance(getattr(FSDPParam, "all_gather_inputs", None), property):
        return 0
    if not getattr(FSDPParam, "_plab_cast_into_output_installed", False):
        original = FSDPParam.all_gather_inputs

        def all_gather_inputs(self):
            if getattr(self, "_plab_cast_into_output", False):
                out = _cast_into_output(self)
                if out is not None:
                    return [out]
            return original.fget(self)
        FSDPParam.all_gather_inputs = property(all_gather_inputs)
        FSDPParam._plab_cast_into_output_installed = True
    for p in params:
        p._plab_cast_into_output = True
    return len(params)


def _cast_into_output(p) -> torch.Tensor | None:
    """The unsharded parameter's storage with the FP32 shard cast into it, or None where FSDP2's own path applies."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState, alloc_storage
    if (getattr(p, "sharded_state", None) != ShardedState.SHARDED or getattr(p, "offload_to_cpu", True)
            or hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather")):
        return None
    src, dtype, outs = p._sharded_param_data, p.param_dtype, p.all_gather_outputs
    if dtype is None or src.dtype == dtype or len(outs) != 1:
        return None
    out = outs[0]
    if out.dtype != dtype or out.numel() != src.numel() or out.device != src.device:
        return None
    alloc_storage(out)  # freed at each reshard; FSDP2 allocates it next anyway (then a no-op)
    with torch.autograd._unsafe_preserve_version_counter(out):  # as FSDP2 writes it: saved views stay valid
        out.copy_(src)
    return out


def _bf16_copy_is_small(module: torch.nn.Module) -> bool:
    device = next(module.parameters()).device
    if device.type != "cuda":
        return True
    n = sum(p.numel() for p in module.parameters())
    return 2 * n < 0.1 * torch.cuda.get_device_properties(device).total_memory


def gradient_sync(net: torch.nn.Module, mode: str, sync: bool):
    """A context for one micro-batch's backward: gradients are reduced across ranks only when `sync` (the last
    micro-batch of a step); DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`."""
    if mode == "ddp" and not sync:
        return net.no_sync()
    if mode == "fsdp" and not getattr(net, "_plab_one_rank_direct", False):  # one rank, direct: never reduced
        net.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor it wraps: what `to_local()` returns outside autograd, without
    its dispatch), the tensor itself otherwise."""
    inner = getattr(t, "_local_tensor", None)
    if inner is not None:
        return inner
    return t.to_local() if hasattr(t, "to_local") else t


class LocalFusedAdamW:
    """torch's fused AdamW step for a subset of a `torch.optim.AdamW(fused=True)`'s parameters, called on the
    local shards of FSDP2's DTensors: the same `_foreach_add_` of the step counters and the same
    `torch._fused_adamw_` call, with the same arguments, that `optimizer.step()` makes, so the same bits (on CUDA
    by default the Triton kernel `optim_kernels.adamw_shard_update`, which makes torch's kernel's arithmetic
    without storing the divided gradients back: bench/shard_adamw_bench.py compares the two element for element) -
    without DTensor's dispatch, which cost more host time than the update's launches (bench/results/
    host_profile_2026-11-24T1900_*: torch's AdamW over the shards 27 ms of host time per 1b step under cProfile,
    ~16 of them in DTensor's argument unwrapping). Parameters without state yet (the first step) or anything
    this does not cover (amsgrad, maximize, capturable, a tensor learning rate) go through
    `optimizer.step()` restricted to the subset, which is always correct."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, kernel: str = "torch"):
        if kernel not in ("auto", "torch"):
            raise ValueError(f"kernel {kernel!r}: one of auto, torch")
        self.optimizer = optimizer
        # "auto": on CUDA training.optim_kernels.adamw_shard_update (torch's arithmetic, the divided gradients not
        # stored back); "torch", or where that does not apply: `torch._fused_adamw_`.
        self.kernel = kernel
        self._tables = None
        # max(1, norm / clip) as a device scalar, or None: global-norm clipping folded into the update, which
        # divides every gradient by it as it reads it (`clip_sharded(..., fold_into=self)`).
        self.grad_scale: torch.Tensor | None = None

    @property
    def usable(self) -> bool:
        """Whether every parameter group takes the local call (once their state exists)."""
        return all(self._covered(g) for g in self.optimizer.param_groups)

    def _covered(self, group: dict) -> bool:
        """Whether `optimizer.step()` would make exactly the call below for this group."""
        return (isinstance(self.optimizer, torch.optim.AdamW) and bool(group.get("fused"))
                and not any(group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable"))
                and not isinstance(group["lr"], torch.Tensor))

    def step(self, ids: set[int], *, grads: dict[int, torch.Tensor] | None = None,
             outs: dict[int, torch.Tensor] | None = None) -> None:
        """Update the parameters in `ids` that have a gradient. `grads` (id -> tensor of the local shard's size):
        the gradients to read instead of `p.grad` (BF16 or FP32: the same update as with their FP32 values).
        `outs` (id -> tensor of the shard's size): copies that receive each updated parameter (cast to their
        dtype) - `OneRankDirectStep`'s unsharded BF16 parameters."""
        opt = self.optimizer
        groups = opt.param_groups
        grad_of = (lambda p: p.grad if p.grad is None else local(p.grad)) if grads is None else (
            lambda p: grads.get(id(p)))
        fallback, batches = False, []
        for g in groups:
            ps = [p for p in g["params"] if id(p) in ids and grad_of(p) is not None]
            if not ps:
                continue
            states = [opt.state.get(p) for p in ps]
            if not self._covered(g) or any(not st for st in states):
                fallback = True
                break
            batches.append((g, ps, states))
        if fallback:
            self._fallback(ids, grads, outs)
            return
        for g, ps, states in batches:
            steps = [st["step"] for st in states]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = g["betas"]
            ws, gs = [local(p) for p in ps], [_shaped(grad_of(p), local(p)) for p in ps]
            ms, vs = [local(st["exp_avg"]) for st in states], [local(st["exp_avg_sq"]) for st in states]
            os = [outs[id(p)] for p in ps] if outs and all(id(p) in outs for p in ps) else None
            if self._use_kernel(ws, gs, ms, vs, steps, os):
                if self._tables is None:
                    self._tables = optim_kernels.AdamWTables()
                optim_kernels.adamw_shard_update(
                    ws, gs, ms, vs, steps, lr=float(g["lr"]), beta1=float(beta1), beta2=float(beta2),
                    weight_decay=float(g["weight_decay"]), eps=float(g["eps"]), grad_scale=self.grad_scale,
                    tables=self._tables, outs=os)
                continue
            # torch's kernel takes gradients of the parameters' dtype: a BF16 gradient's FP32 copy is exact
            gs = [gr if gr.dtype == w.dtype else gr.to(w.dtype) for gr, w in zip(gs, ws)]
            torch._fused_adamw_(ws, gs, ms, vs, [], steps, amsgrad=False, lr=g["lr"], beta1=float(beta1),
                                beta2=float(beta2), weight_decay=g["weight_decay"], eps=g["eps"], maximize=False,
                                grad_scale=self.grad_scale, found_inf=None)
            _copy_out(ps, outs)

    def _fallback(self, ids: set[int], grads, outs) -> None:
        """`optimizer.step()` over the parameters in `ids`: always correct (the first step makes the state).
        Gradients given in `grads` are set as the parameters' `.grad` for it (FP32 copies, exact) and taken off
        again."""
        opt = self.optimizer
        groups = opt.param_groups
        owned = []
        if grads is not None:
            for g in groups:
                for p in g["params"]:
                    gr = grads.get(id(p)) if id(p) in ids else None
                    if gr is not None:
                        p.grad = _as_param_grad(p, gr)
                        owned.append(p)
        if self.grad_scale is not None:  # the division the fused kernel makes as it reads each gradient
            torch._foreach_div_([local(p.grad) for g in groups for p in g["params"]
                                 if id(p) in ids and p.grad is not None], self.grad_scale)
        opt.param_groups = [{**g, "params": [p for p in g["params"] if id(p) in ids]} for g in groups]
        try:
            opt.step()
        finally:
            opt.param_groups = groups
            for p in owned:
                p.grad = None
        _copy_out([p for g in groups for p in g["params"] if id(p) in ids], outs)

    def _use_kernel(self, ws, gs, ms, vs, steps, outs=None) -> bool:
        if self.kernel == "torch" or not ws[0].is_cuda:
            return False
        return (optim_kernels.shard_supported(ws, gs, outs)
                and all(t.dtype == torch.float32 and t.is_contiguous() and t.device == ws[0].device
                        for t in (*ms, *vs, *steps)))


def _shaped(grad: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """`grad` with the local shard's shape (`OneRankDirectStep`'s unsharded gradients: at one rank the shard is the
    whole parameter, so only a view)."""
    return grad if grad.shape == shard.shape else grad.view(shard.shape)


def _as_param_grad(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A gradient for parameter `p` (a DTensor shard, or a plain tensor) holding `grad`'s values in p's dtype."""
    out = torch.empty_like(p)
    local(out).copy_(_shaped(grad, local(out)))
    return out


def _copy_out(params: list[torch.Tensor], outs: dict[int, torch.Tensor] | None) -> None:
    for p in params:
        out = outs.get(id(p)) if outs else None
        if out is not None:
            out.copy_(_shaped(local(p), out).detach())


def clip_sharded(params: list[torch.Tensor], clip: float, device: torch.device, *,
                 fold_into: LocalFusedAdamW | None = None, grads: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Global-norm clipping of sharded (DTensor) gradients: the squared norms of the local shards, summed over
    ranks in one all-reduce; then every gradient divided by max(1, (norm + 1e-6) / clip), the factor of
    `clip_grad_norm_` in the form the unsharded run applies it (`training.optim.clip_gradients`: the optimizer
    divides by it). Returns the global norm (a plain device tensor, the same on every rank).
    `fold_into`: the update that will read these gradients (torch's fused AdamW on the local shards) takes the
    factor as its `grad_scale` and divides each gradient as it reads it - the same division - instead of an
    in-place pass over every FP32 gradient here (8 B per parameter on the step's critical path: the update
    waits for it, and the next forward for the update's first unit).
    `grads`: the gradients to clip instead of the parameters' (`OneRankDirectStep.gradients()`)."""
    import torch.distributed as dist

    if grads is None:
        grads = [local(p.grad) for p in params if p.grad is not None]
    if fold_into is not None:
        fold_into.grad_scale = None
    if not grads:
        return torch.zeros((), device=device)
    sq = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()
    dist.all_reduce(sq)
    norm = sq.sqrt()
    if clip != float("inf"):
        scale = torch.clamp((norm.float() + 1e-6) / clip, min=1.0)
        if fold_into is not None:
            fold_into.grad_scale = scale
        else:
            torch._foreach_div_(grads, scale.to(grads[0].dtype))
    return norm


class OverlappedShardedStep(SideStreamStep):
    """FSDP2's counterpart of `training.optim.OverlappedOptimizerStep`: torch's fused AdamW over the FP32 shards
    (`LocalFusedAdamW`: on their local tensors), run on a side CUDA stream one FSDP unit at a time in forward
    order, so the next step's forward starts while later units are still being updated. Without it the whole
    update (~28 bytes per parameter, ~11 ms for 1.14B on an H100) sat between the backward and the next forward
    (one-process FSDP2 0.884x the unwrapped run; what is left is FSDP2's hooks' host time, bench/NOTES_floor.md 9).

    Ordering: every unit (the root first - embeddings, final norm, LM head, gathered at the root's pre-forward -
    then each block) gets a forward pre-hook, run before FSDP2's own, that makes both the compute stream and
    FSDP2's all-gather copy-in stream wait for that unit's update: with several ranks FSDP2 casts and packs the
    shards on the copy-in stream, with one rank it casts them on the compute stream. Gradients are marked as used
    by the side stream, so the memory `zero_grad` frees is not handed to the next forward before the update has
    read it. `synchronize()` joins the side stream into the compute stream (validation, checkpoints, the end).

    One rank (`prefetch`): FSDP2's one-rank unshard (cast each FP32 shard to BF16, copy it into the unsharded
    parameter: ~10 B per parameter) runs in the unit's pre-forward on the compute stream, between the previous
    unit's kernels and its own. Here unit i's pre-hook instead unshards unit i+1 on a prefetch stream (FSDP2's
    public `unshard()`, under that stream), after unit i+1's update and everything the compute stream has issued,
    so the copies run beside unit i's GEMMs; unit i+1's hook makes the compute stream wait for them, and FSDP2's
    own pre-forward finds the unit unsharded. Only between an update and the unit's first forward after it (the
    first micro-batch of a step); every other unshard (validation, later micro-batches, recomputation in the
    backward) stays FSDP2's. Allocations on the prefetch stream come after it has waited for the compute stream,
    so memory the backward freed is not reused before the backward is done with it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, root: torch.nn.Module, blocks: list[torch.nn.Module], *,
                 prefetch: bool = False, kernel: str = "torch"):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        units = [(root, [p for p in params if id(p) not in in_blocks])]
        units += [(b, [p for p in b.parameters() if p.requires_grad]) for b in blocks]
        if sum(len(ps) for _, ps in units) != len(params):
            raise ValueError("the optimizer's parameters must be the root's and the blocks' own")
        super().__init__(params[0].device)
        self.optimizer = optimizer
        self.update = LocalFusedAdamW(optimizer, kernel=kernel)
        self.units = [(m, {id(p) for p in ps}) for m, ps in units]
        self.handles = [m.register_forward_pre_hook(self._waiter(i), prepend=True)
                        for i, (m, _) in enumerate(units)]
        self.prefetch_stream = torch.cuda.Stream(device=params[0].device) if prefetch else None
        self.prefetched: dict[int, torch.cuda.Event] = {}
        self.prefetches = 0  # units unsharded ahead so far (tests read it)

    def _waiter(self, i: int):
        def hook(module, args):
            event = self.events.pop(i, None)
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
                # Private FSDP2 state: the stream that casts and packs this unit's shards for its all-gather.
                module._get_fsdp_state()._comm_ctx.all_gather_copy_in_stream.wait_event(event)
            done = self.prefetched.pop(i, None)
            if done is not None:
                torch.cuda.current_stream().wait_event(done)
            if self.prefetch_stream is not None and i + 1 < len(self.units):
                self._prefetch(i + 1)
        return hook

    def _prefetch(self, j: int) -> None:
        """Unshard unit j on the prefetch stream, if its update is pending a first forward and it is sharded."""
        update = self.events.get(j)
        unit = self.units[j][0]
        group = unit._get_fsdp_state()._fsdp_param_group  # private FSDP2 state, as above
        if update is None or group is None or group.is_unsharded:
            return
        stream = self.prefetch_stream
        stream.wait_stream(torch.cuda.current_stream())
        stream.wait_event(update)
        with torch.cuda.stream(stream):
            unit.unshard()
            self.prefetched[j] = stream.record_event()
        self.prefetches += 1

    def synchronize(self) -> None:
        super().synchronize()
        if self.prefetch_stream is not None:
            torch.cuda.current_stream().wait_stream(self.prefetch_stream)
        self.prefetched.clear()

    @torch.no_grad()
    def step(self) -> None:
        groups = self.optimizer.param_groups
        self.stream.wait_stream(torch.cuda.current_stream())
        if self.update.grad_scale is not None:
            self.update.grad_scale.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            for i, (_, ids) in enumerate(self.units):
                self.update.step(ids)
                self._record(i)
        for g in groups:
            for p in g["params"]:
                if p.grad is not None:
                    local(p.grad).record_stream(self.stream)


class OneRankDirectStep:
    """FSDP2 on one process without the copies a one-rank group does not need. On N ranks each step casts every
    FP32 shard to BF16 for the all-gather before a unit's forward, and after its backward packs the BF16 gradients
    into an FP32 buffer for the reduce-scatter, which leaves FP32 sharded gradients for the update. On one rank
    there is nothing to gather or reduce: the cast gives the BF16 parameter the update could have written, and
    the pack gives an exact FP32 copy of the BF16 gradient (6 B per parameter, then 4 B instead of 2 B read by
    the gradient norm and the update). FSDP1 switched itself to NO_SHARD at world size 1 for the same reason.

    Here (set up by `shard_model(..., one_rank_direct=True)`) every unit keeps its unsharded BF16 parameters after
    the forward and the backward (FSDP2's `reshard_after_forward=False` and `set_reshard_after_backward(False)`),
    its gradient sync stays off (`set_requires_gradient_sync(False)`), so the backward's BF16 gradients stay on
    the unsharded parameters, and this step reads them: one pass per parameter group reads each BF16 gradient,
    updates the FP32 shard (the master) and its moments with torch's fused AdamW arithmetic, and writes the BF16
    unsharded parameter (`optim_kernels.adamw_shard_update` with BF16 gradients and `outs`) - the 28 B per
    parameter of the unwrapped run's update, the same bits as FSDP2's own one-rank path. The FP32 shards stay the
    model's state: checkpoints (DCP), the Hugging Face export and resumes read and write them; FSDP2's state-dict
    hooks reshard a unit before its state dict is taken or loaded, and its next forward unshards it again.
    With several micro-batches FSDP2 sums them in an FP32 gradient (its reduce dtype), which this step reads.
    Where a unit is not unsharded (after a checkpoint), the BF16 copy is left to its next unshard. Anything the
    fast path does not cover (the first step, CPU, torch's kernel) goes through `LocalFusedAdamW`'s other paths
    with the same gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: list[torch.nn.Module], *, kernel: str = "auto"):
        self.optimizer = optimizer
        self.update = LocalFusedAdamW(optimizer, kernel=kernel)
        self.units = []  # per FSDP2 unit: [(sharded parameter's id, sharded parameter, FSDPParam, its group)]
        for unit in units:
            group = unit._get_fsdp_state()._fsdp_param_group  # private FSDP2 state
            if group is not None:
                self.units.append([(id(fp.sharded_param), fp.sharded_param, fp, group) for fp in group.fsdp_params])
        self.entries = [e for entries in self.units for e in entries]
        self.ids = {e[0] for e in self.entries}
        missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in self.ids]
        if missing:
            raise ValueError(f"{len(missing)} of the optimizer's parameters are not FSDP2's (one-rank direct step)")

    @staticmethod
    def _grad(fp) -> torch.Tensor | None:
        g = fp.unsharded_accumulated_grad
        if g is None and hasattr(fp, "_unsharded_param"):
            g = fp._unsharded_param.grad
        return g

    def gradients(self, entries=None) -> dict[int, torch.Tensor]:
        """The step's gradients by sharded parameter id: FSDP2's FP32 sum over micro-batches where it made one,
        else the unsharded parameter's BF16 gradient."""
        out = {}
        for i, _, fp, _ in self.entries if entries is None else entries:
            g = self._grad(fp)
            if g is not None:
                out[i] = g
        return out

    def gradients_of(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of `params` (sharded parameters), in that order, those without one left out: what the
        gradient norm reads, in the order FSDP2's path reads its sharded gradients (the same sum, the same bits)."""
        by_id = self.gradients()
        return [by_id[id(p)] for p in params if id(p) in by_id]

    @staticmethod
    def _outs(entries) -> dict[int, torch.Tensor]:
        return {i: fp._unsharded_param for i, _, fp, group in entries
                if group.is_unsharded and hasattr(fp, "_unsharded_param")}

    @staticmethod
    def _clear(entries) -> None:
        for _, _, fp, _ in entries:  # the optimizer's zero_grad sees only the (empty) sharded gradients
            fp.unsharded_accumulated_grad = None
            if hasattr(fp, "_unsharded_param"):
                fp._unsharded_param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        state = self.optimizer.state
        grads = self.gradients()
        if all(state.get(p) for i, p, _, _ in self.entries if i in grads):
            self.update.step(self.ids, grads=grads, outs=self._outs(self.entries))
            del grads
            self._clear(self.entries)
            return
        del grads
        # The first step makes the optimizer's state through `optimizer.step()`, which needs FP32 gradients on the
        # shards: made and freed one unit at a time, so the step never holds FP32 copies of every gradient (on a
        # GPU filled to its last gigabytes by the largest model it trains, 4 B per parameter would not fit).
        for entries in self.units:
            grads = self.gradients(entries)
            self.update.step({e[0] for e in entries}, grads=grads, outs=self._outs(entries))
            del grads
            self._clear(entries)

    def synchronize(self) -> None:
        """Nothing runs beside the compute stream."""

    def remove(self) -> None:
        """No hooks to take off."""


# ---------------------------------------------------------------------------------------------------
# activation checkpointing
_SAVED_OPS = None


def _saved_ops() -> set:
    """The ops whose outputs "ops" keeps: matmuls (BF16 and FP8) and attention."""
    global _SAVED_OPS
    if _SAVED_OPS is None:
        aten = torch.ops.aten
        names = ("mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu")
        _SAVED_OPS = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    return _SAVED_OPS


def _op_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _ops_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_op_policy)


def checkpointed_blocks(n_blocks: int, mode: str, every: int) -> list[int]:
    """Indices of the blocks whose activations are recomputed."""
    if mode == "none":
        return []
    if mode == "blocks":
        return [i for i in range(n_blocks) if i % every == every - 1]
    return list(range(n_blocks))


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, every: int = 1) -> dict:
    """Wrap the chosen decoder blocks' forward in `torch.utils.checkpoint` (non-reentrant); returns what was
    done, for the run's metadata."""
    from torch.utils.checkpoint import checkpoint

    from training.model import decoder_blocks
    layers = decoder_blocks(model)
    chosen = checkpointed_blocks(len(layers), mode, every)
    context_fn = _ops_context if mode == "ops" else None
    for i in chosen:
        layer = layers[i]
        kwargs = {"use_reentrant": False, **({"context_fn": context_fn} if context_fn else {})}
        layer.forward = functools.partial(_checkpointed, checkpoint, layer.forward, kwargs)
    return {"mode": mode, **({"every": every} if mode == "blocks" else {}), "blocks": len(chosen),
            "of": len(layers)}


def _checkpointed(checkpoint, forward, ckpt_kwargs, *args, **kwargs):
    return checkpoint(forward, *args, **ckpt_kwargs, **kwargs)
