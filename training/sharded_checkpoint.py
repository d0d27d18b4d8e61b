"""Checkpoints of FSDP2 runs: every rank writes its own shards (`torch.distributed.checkpoint`), nothing is
gathered on one rank to save, and a run resumes on any number of processes (DCP reshards on load).

Layout (`<output_dir>/checkpoints/step_00000100/`, next to the unsharded checkpoints' files):
  dcp/                  the sharded model and optimizer (DCP's `.metadata` + one `__N_0.distcp` per rank)
  rng_00000.pt ...      each rank's RNG state (restored when the run resumes on as many processes)
  training_state.pt     step, tokens, recipe hook states, the run spec, {"sharded": {"world": N}}
  config.json, model.safetensors, tokenizer files
                        the Hugging Face export, read back from `dcp/` by rank 0 in one process after the
                        ranks have written it (`export_hf_from_dcp`), so lm-eval and `from_pretrained` load it

As with unsharded checkpoints, everything is written into `.tmp-step_N` and renamed into place, so a process
killed mid-write never leaves a half-written newest checkpoint.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

DCP_DIR = "dcp"


def is_sharded(path: Path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def _state_dicts(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def save_sharded(root: Path, step: int, *, ctx, model, optimizer, tokenizer=None, hooks=(), extra=None,
                 keep_last: int = 2) -> Path:
    """Checkpoint `step` of a sharded run under `root` (collective: every rank calls it). Returns its path."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from training.checkpoint_files import STATE_FILE, _rng_state, list_checkpoints, write_run_spec

    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ctx.barrier()
    dcp.save(_state_dicts(model, optimizer), checkpoint_id=str(tmp / DCP_DIR))
    torch.save(_rng_state(), tmp / f"rng_{ctx.rank:05d}.pt")
    ctx.barrier()
    if ctx.is_main:
        try:
            config = model.config
            config.architectures = [type(model).__name__]
            config.save_pretrained(tmp)
            save_file(export_hf_from_dcp(tmp / DCP_DIR, config), str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            state = {"step": step, "sharded": {"world": ctx.world}, "rng": _rng_state(),
                     "hooks": [h.state_dict() if hasattr(h, "state_dict") else None for h in hooks], **(extra or {})}
            torch.save(state, tmp / STATE_FILE)
            write_run_spec(tmp, extra)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in list_checkpoints(root.parent)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    ctx.barrier()
    return final


def export_hf_from_dcp(dcp_dir: Path, config) -> dict[str, torch.Tensor]:
    """The Hugging Face weights (FP32, CPU, HF names) of the model saved in `dcp_dir`, read in this process
    alone (no collectives): the shards of every rank are stitched together by DCP's reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from training.checkpoint_files import _hf_tensors, hf_expected_names

    meta = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    model_sd = {}
    for key, md in meta.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            model_sd[key[len("model."):]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    dcp.load({"model": model_sd}, checkpoint_id=str(dcp_dir), no_dist=True)
    return _hf_tensors(model_sd, config, hf_expected_names(config))


def load_sharded(path: Path, *, ctx, model, optimizer, hooks=()) -> dict:
    """Restore a sharded checkpoint into this (sharded) run in place, on any number of processes; returns the
    training state (step, ...). RNG states come back only on as many processes as wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from training.checkpoint_files import STATE_FILE, _set_rng_state

    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    sd = _state_dicts(model, optimizer)
    dcp.load(sd, checkpoint_id=str(path / DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    rng = path / f"rng_{ctx.rank:05d}.pt"
    if state["sharded"]["world"] == ctx.world and rng.exists():
        _set_rng_state(torch.load(rng, map_location="cpu", weights_only=False))
    for hook, hs in zip(hooks, state.get("hooks", [])):
        if hs is not None and hasattr(hook, "load_state_dict"):
            hook.load_state_dict(hs)
    return state
