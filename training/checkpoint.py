"""Checkpoints: HF format for everyone else, plus the training state for exact resume.

Layout (`<output_dir>/checkpoints/step_00000100/`):
  config.json, model.safetensors, tokenizer files   ← `AutoModelForCausalLM.from_pretrained(dir)` and
                                                        `lm-eval --model hf` load these without our code
  training_state.pt                                  ← optimizer, RNG states, step/tokens (the data
                                                        position: batches are a function of (seed, step)),
                                                        recipe hook states, the run spec

Weights are saved in FP32: they are the master weights, and resume must be bit-exact.
A checkpoint is written into a temporary sibling directory and renamed into place, so a process
killed mid-write leaves at most a stray `.tmp-*` directory, never a half-written "latest" checkpoint.

`Checkpointer` is what the train loop uses: it saves at a step boundary (with the metrics up to that step
durable in the sink first) and resumes a run from its newest checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from training.checkpoint_files import (STATE_FILE, _hf_tensors, _rng_state, _set_rng_state, checkpoints_root,
                                       hf_expected_names, latest_checkpoint, list_checkpoints, write_run_spec)
from training.config import LEGACY_DATA, DataSpec, RunSpec, SpecError



def hf_state_dict(model: torch.nn.Module, optimizer=None) -> dict[str, torch.Tensor]:
    """Plain FP32 CPU tensors under the names a fresh model of the same architecture expects.

    With an optimizer that keeps FP32 master weights (training.optim.MasterAdamW, BF16 parameters), the
    masters are written, not the BF16 parameters rounded from them.

    Recipe conversions may wrap modules or add buffers (e.g. amax histories); those are kept out of the
    HF weights (they travel in the hook state) so plain transformers loads the file.
    """
    from training.model import split_fused
    expected = hf_expected_names(model.config)
    masters = {}
    if optimizer is not None and hasattr(optimizer, "master"):
        masters = {name: optimizer.master(p) for name, p in model.named_parameters() if p in optimizer.state}
    masters = split_fused(masters, model.config)
    return _hf_tensors(model.state_dict(), model.config, expected, masters)


def save_checkpoint(output_dir, step: int, *, model, optimizer, tokenizer=None, hooks=(), extra=None,
                    keep_last: int = 2) -> Path:
    """Write checkpoint `step` atomically; prune all but the newest `keep_last`. Returns its path."""
    root = checkpoints_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step:08d}-", dir=root))
    try:
        config = model.config
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        save_file(hf_state_dict(model, optimizer), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "rng": _rng_state(),
            "hooks": [h.state_dict() if hasattr(h, "state_dict") else None for h in hooks],
            **(extra or {}),
        }
        torch.save(state, tmp / STATE_FILE)
        write_run_spec(tmp, extra)
        if final.exists():  # re-saving the same step (e.g. final == periodic): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path, *, model, optimizer, hooks=(), map_location="cpu") -> dict:
    """Restore weights, optimizer, RNG and hook states in place; returns the state dict (step, ...)."""
    path = Path(path)
    weights = load_file(str(path / "model.safetensors"))
    from training.model import join_fused, split_fused
    params = dict(model.named_parameters())
    missing = [n for n in split_fused(params, model.config) if n not in weights]
    if missing:
        raise RuntimeError(f"checkpoint {path} lacks parameters {missing[:5]}; it was written for a "
                           f"different model")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(join_fused(weights, name).to(p.device, p.dtype))
    state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    hook_states = state.get("hooks", [])
    for hook, hs in zip(hooks, hook_states):
        if hs is not None and hasattr(hook, "load_state_dict"):
            hook.load_state_dict(hs)
    return state


@dataclass
class TrainState:
    """Where a run stands besides its weights and optimizer: what a checkpoint stores with them."""
    step: int = 0                    # optimizer steps completed
    tokens: int = 0                  # training tokens consumed (global)
    wall_offset: float = 0.0         # seconds trained before this process started (by earlier attempts)
    loss: float | None = None        # the last finite training loss logged
    val_loss: float | None = None
    started: float = field(default_factory=time.perf_counter, compare=False)  # perf_counter() at the loop start

    def wall_time(self, now: float | None = None) -> float:
        """Seconds trained so far, over every attempt of the run."""
        return self.wall_offset + (time.perf_counter() if now is None else now) - self.started


def numerics_identity(spec_dict: dict) -> dict:
    """The parts of a spec that decide the numbers a run produces (not how fast or where it runs)."""
    d = {k: v for k, v in spec_dict.items() if k not in ("training", "data")}
    # Data keys a spec saved before they existed lacks take their defaults (the behaviour it ran with); the number
    # of tokenizer processes and the bad-line threshold do not change the tokens of a cache that was built.
    # The exceptions are LEGACY_DATA's keys: their default changed when they were added, and a spec saved before ran
    # with the legacy value (val_windows "first", eos_at_split false).
    data = {**asdict(DataSpec()), **LEGACY_DATA, **(spec_dict.get("data") or {})}
    if not _splits_text_files(data):
        data["eos_at_split"] = False  # no text file's tail is cut off: the key changes no token
    d["data"] = {k: v for k, v in data.items() if k not in ("num_proc", "max_bad_fraction")}
    d["training"] = {k: v for k, v in spec_dict["training"].items()
                     if k not in ("perf", "device", "gpus", "nodes", "compile", "checkpoint_every", "queue", "parallel",
                                  "activation_checkpointing", "activation_checkpointing_every")}
    # A fused QKV projection changes the parameter list (and a recipe's scaling of it).
    d["training"]["perf.fuse_qkv"] = (spec_dict["training"].get("perf") or {}).get("fuse_qkv")
    d["training"]["perf.fuse_gate_up"] = bool((spec_dict["training"].get("perf") or {}).get("fuse_gate_up"))
    return d


def _splits_text_files(data: dict) -> bool:
    """Whether the corpus of a spec's `data` holds text files whose tails are held out (what data.eos_at_split
    changes): not with data.val_corpus, not for the random corpus nor one of JSON lines/tables only. A corpus that
    cannot be listed here counts as one that does."""
    from training.config import RANDOM_CORPUS
    from training.shards import splits_text_files

    if data.get("val_corpus") or data.get("corpus") == RANDOM_CORPUS:
        return False
    try:
        corpus = DataSpec(corpus=data["corpus"], text_field=data.get("text_field") or "text").open_corpus()
    except Exception:  # noqa: BLE001 - moved or unreadable: compare the key as written
        return True
    return splits_text_files(corpus, has_val_corpus=False)


def _difference(saved: dict, spec: RunSpec) -> str:
    """Where the checkpoint's spec and this one differ, in words (the first few fields)."""
    a, b = numerics_identity(saved), numerics_identity(spec.to_dict())
    def short(v) -> str:
        text = repr(v)
        return text if len(text) <= 60 else text[:59] + "…"

    diffs = [f"{section}.{key}: the checkpoint's {short(a[section].get(key))}, this spec's {short(b[section].get(key))}"
             for section in ("data", "training") for key in sorted(set(a[section]) | set(b[section]))
             if a[section].get(key) != b[section].get(key)]
    diffs += [f"{key}: the checkpoint's {short(a.get(key))}, this spec's {short(b.get(key))}"
              for key in sorted(set(a) | set(b)) if key not in ("data", "training") and a.get(key) != b.get(key)]
    if not diffs:
        return ""
    settings = [f"data.{key} to {json.dumps(a['data'].get(key))}" for key in LEGACY_DATA  # as a spec spells it
                if a["data"].get(key) != b["data"].get(key)]
    hint = f"; to resume it, set {' and '.join(settings)}" if settings and len(settings) == len(diffs) else ""
    return f" ({'; '.join(diffs[:4])}{'; ...' if len(diffs) > 4 else ''}){hint}"


def _refuse_other_data(path: Path, saved: str | None, now: str | None) -> None:
    """The same spec names a corpus by its path; the files there may have changed since the checkpoint (a file
    added, removed or edited): the tokenizer is then trained again and the token order differs, and a resumed run
    would go on with another tokenizer's ids under weights trained on the first one's. Checkpoints from before the
    token cache was recorded are not checked."""
    from training.shards import same_token_data

    if saved and now and not same_token_data(saved, now):
        raise SpecError(f"checkpoint {path} was trained on other data: the corpus the spec names now gives token "
                        f"cache {now}, the checkpoint's was {saved} (a file of data.corpus was added, removed or "
                        f"changed since, which retrains the tokenizer and reorders the tokens, or the tokenizer "
                        f"itself changed); restore the corpus as it was, or start a new run in another output_dir "
                        f"(plab train --output) or with resume=False (--no-resume)")


def set_aside_checkpoints(output_dir) -> Path | None:
    """A new run (resume=False) in a folder that holds an earlier run's checkpoints: they are moved to
    checkpoints.before-<UTC time> beside, not mixed with the new run's (the newest two by step number are kept,
    so an earlier run's later steps pruned the new run's own, and a step of the same number counted as saved).
    Returns where they went; None when there were none."""
    root = checkpoints_root(output_dir)
    if latest_checkpoint(output_dir) is None:
        return None
    import datetime as dt

    aside = root.with_name(f"checkpoints.before-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S%fZ}")
    root.rename(aside)
    return aside


class Checkpointer:
    """Saves a run at step boundaries and resumes it from its newest checkpoint under `output_dir`
    (None: never saves, always starts fresh).

    `settle()` makes pending optimizer work land in the weights (the overlapped update); `flush_metrics()`
    hands the sink every step logged so far. Both run before a save, then the sink's own `flush`, so a
    resume from the checkpoint never loses or re-logs a step. Rank 0 writes; every rank waits for it.
    """

    def __init__(self, output_dir, *, spec: RunSpec, ctx, sink, model, optimizer, tokenizer=None, hooks=(),
                 settle: Callable[[], None] = lambda: None, flush_metrics: Callable[[], None] = lambda: None,
                 sharded: bool = False, data_cache: str | None = None):
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.data_cache = data_cache  # the token cache the run trains on (its name hashes the corpus, tokenizer)
        self.sharded = sharded  # FSDP2: every rank saves its shards (training.sharded_checkpoint)
        self.spec, self.ctx, self.sink = spec, ctx, sink
        self.model, self.optimizer, self.tokenizer, self.hooks = model, optimizer, tokenizer, list(hooks)
        self.settle, self.flush_metrics = settle, flush_metrics
        self.last_path: Path | None = latest_checkpoint(output_dir) if output_dir is not None else None

    @property
    def enabled(self) -> bool:
        return self.output_dir is not None

    def resume(self, state: TrainState) -> Path | None:
        """Restore the newest checkpoint in place - weights, optimizer, RNG, recipe hooks, and `state` -
        and return its path; None (nothing changed) when there is none. Refuses a checkpoint written by a
        different run spec."""
        latest = latest_checkpoint(self.output_dir) if self.enabled else None
        if latest is None:
            return None
        saved = self._load(latest)
        if saved.get("spec") is not None and numerics_identity(saved["spec"]) != numerics_identity(self.spec.to_dict()):
            raise SpecError(f"checkpoint {latest} was written by a different run spec{_difference(saved['spec'], self.spec)}; "
                            f"use another output_dir, or resume=False to start a new run there "
                            f"(plab train --no-resume: the earlier checkpoints are moved aside)")
        _refuse_other_data(latest, saved.get("data_cache"), self.data_cache)
        state.step, state.tokens = saved["step"], saved["tokens"]
        state.wall_offset = saved.get("wall_time", 0.0)
        state.loss, state.val_loss = saved.get("loss"), saved.get("val_loss")
        self.sink.event("resumed", step=state.step, path=str(latest))
        return latest

    def _load(self, path: Path) -> dict:
        from training import sharded_checkpoint as sc
        if sc.is_sharded(path) != self.sharded:
            written, needed = ("an FSDP run", "'fsdp'") if sc.is_sharded(path) else ("a run without FSDP", "'ddp'")
            raise SpecError(f"checkpoint {path} was written by {written}; resume it with training.parallel={needed} "
                            f"(its model.safetensors also starts a new run through model weights), or use another "
                            f"output_dir")
        if self.sharded:
            return sc.load_sharded(path, ctx=self.ctx, model=self.model, optimizer=self.optimizer, hooks=self.hooks)
        state = load_checkpoint(path, model=self.model, optimizer=self.optimizer, hooks=self.hooks)
        per_rank = state.get("rng_per_rank")
        if per_rank is not None and len(per_rank) == self.ctx.world:
            # this rank's own generators, not rank 0's (load_checkpoint restored those): a run of N processes
            # resumed on N continues bit for bit; on another number the ranks' streams start where rank 0's was
            _set_rng_state(per_rank[self.ctx.rank])
        return state

    def is_saved(self, step: int) -> bool:
        """Whether the newest checkpoint this run knows of is the one of `step`."""
        return self.last_path is not None and self.last_path.name == f"step_{step:08d}"

    def save(self, step: int, state: TrainState) -> Path:
        """Checkpoint `step` (collective: every rank calls it). Returns its path on every rank."""
        if not self.enabled:
            raise RuntimeError("this run has no output_dir to save checkpoints in")
        self.settle()
        self.flush_metrics()  # metrics up to `step` reach the sink before the checkpoint claims them done
        self.sink.flush()     # ...and are durable there
        path = checkpoints_root(self.output_dir) / f"step_{step:08d}"
        extra = {"tokens": state.tokens, "wall_time": state.wall_time(), "loss": state.loss,
                 "val_loss": state.val_loss, "spec": self.spec.to_dict(), "data_cache": self.data_cache}
        if self.sharded:
            from training.sharded_checkpoint import save_sharded
            path = save_sharded(checkpoints_root(self.output_dir), step, ctx=self.ctx, model=self.model,
                                optimizer=self.optimizer, tokenizer=self.tokenizer, hooks=self.hooks, extra=extra)
            self.sink.event("checkpoint", step=step, path=str(path))
            self.last_path = path
            return path
        if self.ctx.enabled:
            # Every rank's generators (each rank has its own seed, and NVFP4's stochastic rounding draws from
            # them): rank 0 writes them all, each rank gets its own back on resume (`_load`). Gathered over the
            # gloo side group: CPU objects, no wait on the GPU stream.
            import torch.distributed as dist

            per_rank = [None] * self.ctx.world
            dist.all_gather_object(per_rank, _rng_state(), group=self.ctx.stop_group)
            extra["rng_per_rank"] = per_rank
        if self.ctx.is_main:
            path = save_checkpoint(
                self.output_dir, step, model=self.model, optimizer=self.optimizer, tokenizer=self.tokenizer,
                hooks=self.hooks, extra=extra)
            self.sink.event("checkpoint", step=step, path=str(path))
        self.ctx.barrier()
        self.last_path = path
        return path
