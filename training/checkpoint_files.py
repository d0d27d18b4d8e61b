"""The files of a checkpoint folder shared by unsharded (training.checkpoint) and sharded
(training.sharded_checkpoint) checkpoints: where they live, which are complete, the RNG states, and the
Hugging Face weights narrowed from a model's state."""
from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "training_state.pt"
# The run spec a checkpoint was trained with, as JSON beside the weights: what `plab eval` reads of a folder (the
# state file is a pickle, loaded only from a run's own output folder when it resumes).
RUN_SPEC_FILE = "run_spec.json"


def write_run_spec(folder: Path, extra: dict | None) -> None:
    """The checkpoint's run spec (`extra["spec"]`, when the checkpointer gave one) as RUN_SPEC_FILE."""
    spec = (extra or {}).get("spec")
    if isinstance(spec, dict):
        import json
        (Path(folder) / RUN_SPEC_FILE).write_text(json.dumps(spec, indent=1, sort_keys=True))
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoints_root(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def _hf_tensors(state: dict, config, expected: set, masters: dict | None = None) -> dict[str, torch.Tensor]:
    """`state` (our model's names, fused projections split) narrowed to the HF names in `expected`, as plain
    FP32 CPU tensors; `masters` replace the values they name."""
    from training.model import split_fused
    masters = masters or {}
    out = {}
    for name, value in split_fused(state, config).items():
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


def hf_expected_names(config) -> set:
    """The tensor names a fresh model of `config`'s architecture loads, a tied weight (an LM head sharing the
    embedding) once, under its first name: from_pretrained ties the other to it, and the value written is
    the one the optimizer updates (its master, for BF16 parameters)."""
    from training.model import meta_model
    names, seen = set(), set()
    for name, tensor in meta_model(config).state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.add(name)
    return names


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
        except (RuntimeError, IndexError):  # another GPU count on resume: NVFP4's stochastic rounding restarts its draws
            pass


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
