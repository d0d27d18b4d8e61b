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
"""
from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STATE_FILE = "training_state.pt"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoints_root(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def hf_state_dict(model: torch.nn.Module, optimizer=None) -> dict[str, torch.Tensor]:
    """Plain FP32 CPU tensors under the names a fresh `LlamaForCausalLM` expects.

    With an optimizer that keeps FP32 master weights (training.optim.MasterAdamW, BF16 parameters), the
    masters are written, not the BF16 parameters rounded from them.

    Recipe conversions may wrap modules or add buffers (e.g. amax histories); those are kept out of the
    HF weights (they travel in the hook state) so plain transformers loads the file.
    """
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        reference = LlamaForCausalLM(model.config)
    from training.model import split_fused
    expected = set(reference.state_dict())
    masters = {}
    if optimizer is not None and hasattr(optimizer, "master"):
        masters = {name: optimizer.master(p) for name, p in model.named_parameters() if p in optimizer.state}
    masters = split_fused(masters, model.config)
    out = {}
    for name, value in split_fused(model.state_dict(), model.config).items():
        if name not in expected:
            continue
        value = masters.get(name, value)
        if type(value) is not torch.Tensor and hasattr(value, "dequantize"):
            value = value.dequantize()
        out[name] = value.detach().to("cpu", torch.float32).contiguous().clone()
    missing = expected - set(out)
    if missing:
        raise RuntimeError(f"model is missing weights {sorted(missing)[:5]}... needed for an HF checkpoint")
    return out


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all(state["cuda"])
        except (RuntimeError, IndexError):  # different GPU count on resume: CUDA RNG is not used by training
            pass


def save_checkpoint(output_dir, step: int, *, model, optimizer, tokenizer=None, hooks=(), extra=None,
                    keep_last: int = 2) -> Path:
    """Write checkpoint `step` atomically; prune all but the newest `keep_last`. Returns its path."""
    root = checkpoints_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step:08d}-", dir=root))
    try:
        config = model.config
        config.architectures = ["LlamaForCausalLM"]
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
        if final.exists():  # re-saving the same step (e.g. final == periodic): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(output_dir) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).exists()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(output_dir) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


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
