"""AdamW over FP32 master weights for a model whose parameters are BF16 (Megatron / Apex "O2" style).

The model computes in BF16 with BF16 parameters (no autocast casts of FP32 weights in the forward, no
FP32 copies of BF16 weight gradients in the backward); the optimizer holds, per parameter, an FP32
master copy and FP32 moments. One step per parameter, as one fused elementwise pass:

    g  = grad (BF16) / grad_scale            (grad_scale folds global-norm clipping in, as fused AdamW)
    m  = beta1 m + (1 - beta1) g             v = beta2 v + (1 - beta2) g^2
    w  = w (1 - lr wd) - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)     (FP32 master)
    p  = bf16(w)                             (round to nearest even)

which is torch.optim.AdamW's update (decoupled weight decay, bias correction) applied to the master.
Memory traffic per parameter: 2 B grad + 8 B master + 16 B moments + 2 B param = 28 B (torch's fused
AdamW on FP32 parameters under autocast also moves 28 B, plus the autocast casts: 6 B in the forward,
6 B to turn each BF16 weight gradient into an FP32 one, and often a recomputed cast in the backward).

How a list of parameters (an overlap bucket's, or a whole group) is updated, `update`:
- "triton" (the CUDA default): one Triton kernel launch per list (training.optim_kernels), the eager update op
  for op (bit-exact on CPU under Triton's interpreter); nothing synchronises with the host (learning rate,
  weight decay, step counts and the clipping factor are device tensors).
- "compiled": one `torch.compile`d call per list (chunks of 8 for a whole group; dynamic shapes, one graph per
  list length), which inductor turns into one kernel per parameter. Inductor contracts other multiply-adds
  than the eager ops do, so it is not bit-exact with them. A compiled call per parameter instead cost
  ~0.2-0.3 ms of host time each (Dynamo cache lookup, AOTAutograd wrapper, the separate step increment):
  115 calls, ~30 ms of host time per 1.14B step, enough to make FP8 steps wait on the host.
- "eager": the torch ops below, one parameter at a time (the CPU default, and the reference).
"""
from __future__ import annotations

import functools
import math

import torch

from training.config import PerfOptions

MASTER_KEYS = ("master", "exp_avg", "exp_avg_sq")


def _adamw_master_update(p, g, w, m, v, lr, step, grad_scale, beta1: float, beta2: float, eps: float,
                         wd: float):
    g32 = g.float()
    if grad_scale is not None:
        g32 = g32 / grad_scale
    m.lerp_(g32, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g32, g32, value=1.0 - beta2)
    bias1 = 1.0 - torch.pow(beta1, step)
    bias2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, step))
    w.mul_(1.0 - lr * wd)
    denom = v.sqrt() / bias2_sqrt + eps
    w.sub_((lr / bias1) * m / denom)
    p.copy_(w)


def _adamw_master_update_many(ps, gs, ws, ms, vs, lr, steps, grad_scale, beta1: float, beta2: float, eps: float,
                              wd):
    """`_adamw_master_update` for lists of tensors (the step counters incremented first, as torch's AdamW)."""
    torch._foreach_add_(steps, 1.0)
    for p, g, w, m, v, step in zip(ps, gs, ws, ms, vs, steps):
        _adamw_master_update(p, g, w, m, v, lr, step, grad_scale, beta1, beta2, eps, wd)


_compiled_update = None
CHUNK = 8  # parameters per compiled call when a whole parameter group is updated at once
UPDATES = PerfOptions.OPTIMIZER_UPDATES  # "auto", "triton", "compiled", "eager"


def _compiled_update_fn():
    global _compiled_update
    if _compiled_update is None:
        _compiled_update = torch.compile(_adamw_master_update_many, fullgraph=True, dynamic=True)
    return _compiled_update


class MasterAdamW(torch.optim.Optimizer):
    """AdamW keeping FP32 master weights and moments for (usually BF16) parameters.

    `grad_scale` (attribute, a device scalar or None): every gradient is divided by it as it is read,
    like torch's fused AdamW; train.py sets it to max(1, norm / clip) for global-norm clipping.
    `update`: "auto" (the Triton kernel on CUDA where Triton and the dtypes allow, eager elsewhere),
    "triton", "compiled" or "eager"; see the module docstring.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, *, update: str = "auto"):
        if update not in UPDATES:
            raise ValueError(f"update must be one of {', '.join(UPDATES)}, got {update!r}")
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"lr must be a number >= 0, got {lr!r}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas!r}")
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.grad_scale: torch.Tensor | None = None
        self.update = update
        self._tables = None  # the Triton kernel's address tables (training.optim_kernels.AdamWTables)
        # The Triton update's grid: None, one program per block of elements; an int, at most that many programs,
        # each looping over blocks (so the update occupies that many SMs beside the forward; training.optim's
        # OverlappedOptimizerStep with an SM carve-out).
        self.update_programs: int | None = None
        # State exists from the start (not lazily at the first step), so a checkpoint written before any
        # step, and load_state_dict into a fresh optimizer, both see the master weights.
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_floating_point():
                    raise ValueError(f"MasterAdamW needs floating-point parameters, got {p.dtype}")
                self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "master": p.detach().to(torch.float32).clone(memory_format=torch.contiguous_format),
                    "exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                    "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                }
        self._lr_tensors: dict[int, torch.Tensor] = {}
        self._wd_tensors: dict[int, torch.Tensor] = {}

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The FP32 master copy of parameter `p` (what checkpoints save)."""
        return self.state[p]["master"]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts floating state to each parameter's dtype (BF16 here): put the FP32 masters
        and moments back from the saved tensors themselves, bit for bit."""
        from itertools import chain
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            missing = [k for k in MASTER_KEYS if k not in saved]
            if missing:
                raise ValueError(f"optimizer state has no {missing} for a parameter: it was not written by "
                                 f"MasterAdamW (a checkpoint of an FP32-parameter run cannot resume here)")
            for key in (*MASTER_KEYS, "step"):
                self.state[p][key] = saved[key].detach().to(device=p.device, dtype=torch.float32).clone()

    def _lr_tensor(self, i: int, group: dict, device: torch.device) -> torch.Tensor:
        t = self._lr_tensors.get(i)
        if t is None or t.device != device:
            t = self._lr_tensors[i] = torch.zeros((), dtype=torch.float32, device=device)
        t.fill_(float(group["lr"]))  # a fill kernel with the value as argument: no host sync
        return t

    def _wd_tensor(self, i: int, group: dict, device: torch.device) -> torch.Tensor:
        """Weight decay as a device scalar: groups that differ only in it share one compiled graph."""
        t = self._wd_tensors.get(i)
        if t is None or t.device != device:
            t = self._wd_tensors[i] = torch.zeros((), dtype=torch.float32, device=device)
        t.fill_(float(group["weight_decay"]))
        return t

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_params(None)
        return loss

    @torch.no_grad()
    def step_params(self, subset) -> None:
        """Update the parameters in `subset` (None: all) on the current stream."""
        wanted = None if subset is None else {id(p) for p in subset}
        scale = self.grad_scale
        for i, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            eps = float(group["eps"])
            todo = []
            for p in group["params"]:
                if p.grad is None or (wanted is not None and id(p) not in wanted):
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("MasterAdamW does not support sparse gradients")
                todo.append(p)
            if not todo:
                continue
            device = todo[0].device
            lr_t, wd_t = self._lr_tensor(i, group, device), self._wd_tensor(i, group, device)
            s = scale.to(device) if scale is not None else None
            states = [self.state[p] for p in todo]
            fn, size = self._update_fn(todo)
            # A bucket's parameters in one call; a whole group at once (Triton) or in chunks of CHUNK.
            size = len(todo) if subset is not None or size is None else size
            for k in range(0, len(todo), size):
                chunk, st = todo[k:k + size], states[k:k + size]
                fn([p.view(-1) for p in chunk], [p.grad.view(-1) for p in chunk],
                   [x["master"].view(-1) for x in st], [x["exp_avg"].view(-1) for x in st],
                   [x["exp_avg_sq"].view(-1) for x in st], lr_t, [x["step"] for x in st], s,
                   float(beta1), float(beta2), eps, wd_t)

    def _update_fn(self, params: list[torch.Tensor]):
        """(update function, parameters per call: None = all) for this list, by `update`."""
        from training import optim_kernels

        mode = self.update
        if mode == "auto":
            # CUDA tensors the kernel cannot take (FP32 parameters) keep the compiled update.
            mode = ("eager" if not params[0].is_cuda else
                    "triton" if optim_kernels.supported(params, [p.grad for p in params]) else "compiled")
        if mode == "triton":
            if not optim_kernels.supported(params, [p.grad for p in params]):
                raise ValueError("update='triton' needs BF16 parameters and gradients on one device, and "
                                 "Triton installed; use update='auto'")
            if self._tables is None:
                self._tables = optim_kernels.AdamWTables()
            return functools.partial(optim_kernels.adamw_master_update, tables=self._tables,
                                     programs=self.update_programs), None
        if mode == "compiled":
            return _compiled_update_fn(), CHUNK
        return _adamw_master_update_many, CHUNK


class SideStreamStep:
    """What the overlapped optimizer steps share: a side CUDA stream for the update, one event per unit of
    parameters (set by `step`, consumed by the forward pre-hooks), and joining the side stream back."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)
        self.events: dict[int, torch.cuda.Event] = {}
        self.handles: list = []

    def _record(self, i: int) -> None:
        event = torch.cuda.Event()
        event.record(self.stream)
        self.events[i] = event

    def synchronize(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)
        self.events.clear()

    def remove(self) -> None:
        self.synchronize()
        for h in self.handles:
            h.remove()


class OverlappedOptimizerStep(SideStreamStep):
    """Runs a MasterAdamW step on a side CUDA stream, bucket by bucket in forward order, so that the next
    step's forward starts while later buckets are still being updated (the idea of Megatron's
    overlap of the parameter all-gather with the forward, applied to the update itself).

    `buckets`: (module, parameters) in the order the forward uses them; each module gets a forward
    pre-hook that makes the compute stream wait for its bucket's update (a CUDA event: no host sync).
    The side stream first waits for everything the compute stream has issued (backward, gradient norm,
    clipping factor). Gradients and the clipping factor are marked as used by the side stream, so the
    caching allocator does not hand their memory out again before the update has read them.
    `synchronize()` makes the compute stream wait for the whole update (before checkpoints, validation).
    """

    def __init__(self, optimizer: MasterAdamW, buckets: list[tuple[torch.nn.Module, list[torch.Tensor]]]):
        if not isinstance(optimizer, MasterAdamW):
            raise TypeError("OverlappedOptimizerStep needs a MasterAdamW")
        owned = {p for g in optimizer.param_groups for p in g["params"]}
        covered = [p for _, ps in buckets for p in ps]
        if len(covered) != len(set(covered)) or set(covered) != owned:
            raise ValueError("the buckets must hold every optimizer parameter exactly once")
        super().__init__(covered[0].device)
        self.optimizer = optimizer
        self.buckets = buckets
        self.handles = [m.register_forward_pre_hook(self._waiter(i)) for i, (m, _) in enumerate(buckets)]

    def _waiter(self, i: int):
        def hook(module, args):
            event = self.events.pop(i, None)
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
        return hook

    @torch.no_grad()
    def step(self) -> None:
        opt = self.optimizer
        self.stream.wait_stream(torch.cuda.current_stream())
        if opt.grad_scale is not None:
            opt.grad_scale.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            for i, (_, params) in enumerate(self.buckets):
                opt.step_params(params)
                self._record(i)
        for _, params in self.buckets:
            for p in params:
                if p.grad is not None:
                    p.grad.record_stream(self.stream)


def lr_at(step: int, spec) -> float:
    """Learning rate of optimizer step `step` (1-based) of a `RunSpec`: linear warm-up, then cosine decay
    to min_lr_ratio·lr."""
    t = spec.training
    total = spec.total_steps
    if t.warmup_steps > 0 and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    decay_steps = max(total - t.warmup_steps, 1)
    progress = min(max(step - t.warmup_steps, 0) / decay_steps, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine)


def clip_gradients(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, clip: float, *, fused: bool,
                   device: torch.device) -> torch.Tensor:
    """Global gradient norm of `params` (a device tensor: no host sync); clips to `clip` (inf: never).

    `fused`: the norm from per-tensor norms, and the clipping left to the optimizer, which divides every
    gradient by `optimizer.grad_scale` as it reads it (torch's fused AdamW and MasterAdamW both do): the same
    min(1, clip / (norm + 1e-6)) factor as `clip_grad_norm_`, without its in-place pass over the gradients."""
    if not fused:
        return torch.nn.utils.clip_grad_norm_(params, clip)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    # Per-tensor norms in FP32 (BF16 gradients would otherwise give BF16-rounded norms).
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
    optimizer.grad_scale = (torch.clamp((norm.float() + 1e-6) / clip, min=1.0)
                            if math.isfinite(clip) else None)
    return norm
