"""A run's held-out text for the held-out bits-per-byte task (plab_heldout_bpb), made from its own validation split,
and the context it trained its model on: from the run spec, which the worker has from the API and `plab eval` finds in
a checkpoint folder of the lab (its training_state.pt), so a figure by hand is the worker's figure."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

HELDOUT_CHUNK_TOKENS = 8192  # the pieces of a spread held-out text: whole ~4 KiB documents of the bpb task, several


def heldout_slices(n_val: int, max_tokens: int, rule: str) -> list[slice]:
    """Which tokens of a validation split of `n_val` tokens the held-out text is made of: all of them when they fit
    in `max_tokens`; else the first `max_tokens` (data.val_windows "first", as before it existed) or
    max_tokens // HELDOUT_CHUNK_TOKENS chunks, each in the middle of one of as many equal parts of the split
    ("spread", as the val loss's windows: every file's held-out part, not the first books')."""
    if n_val <= max_tokens:
        return [slice(0, n_val)]
    if rule == "first":
        return [slice(0, max_tokens)]
    from training.data import spread_slots

    size = HELDOUT_CHUNK_TOKENS
    slots = spread_slots(n_val // size, max(max_tokens // size, 1))
    return [slice(int(slot) * size, (int(slot) + 1) * size) for slot in slots]


def documents_text(tok, ids: list[int]) -> str:
    """Token ids of packed documents as text: each document decoded on its own, a blank line between them - not the
    separators' own text ("<|endoftext|>" would be scored as a special token and counted as 13 bytes)."""
    special = {t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None}
    documents, current = [], []
    for i in ids:
        if i in special:
            documents.append(current)
            current = []
        else:
            current.append(i)
    documents.append(current)
    return "\n\n".join(text for text in (tok.decode(d) for d in documents if d) if text.strip())


def validation_text(spec: dict, out: os.PathLike, max_tokens: int = 400_000) -> str | None:
    """The experiment's held-out text (the validation split the loop reports val/loss on), decoded from its
    token shard, for the held-out bits-per-byte task: under data.val_windows "spread", `heldout_slices` of it, its
    pieces and documents joined by a blank line; under "first" (runs stored before the rule existed), its first
    `max_tokens` decoded as they always were (separators' text included), so their results stay paired with earlier
    ones. None for synthetic corpora."""
    from pathlib import Path

    from training.config import RANDOM_CORPUS, RunSpec, plab_home
    from training.setup import open_token_dataset

    rs = RunSpec.from_dict(spec)
    if rs.data.corpus == RANDOM_CORPUS:
        return None
    out = Path(out)
    if not out.is_file():
        tok, ds = open_token_dataset(rs, plab_home() / "cache")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        if rs.data.val_windows == "first":  # the text as it always was, byte for byte: results stay paired
            tmp.write_text(tok.decode(ds.val[:max_tokens].tolist()))
        else:
            pieces = heldout_slices(len(ds.val), max_tokens, rs.data.val_windows)
            tmp.write_text("\n\n".join(documents_text(tok, ds.val[piece].tolist()) for piece in pieces))
        tmp.replace(out)
    return str(out)


def trained_context(spec: dict) -> int | None:
    """The context a run trained its model on, from its spec, for checkpoints that do not record it (written before
    they did): data.seq_len for a model trained from random weights; None (the checkpoint's own record, else
    lm-eval's max length) for a run continued from a checkpoint, whose model may have learned longer contexts."""
    from training.config import RunSpec, SpecError

    try:
        rs = RunSpec.from_dict(spec, check_paths=False)
    except (SpecError, TypeError, KeyError):
        return None
    return rs.data.seq_len if rs.model.source != "checkpoint" else None


def checkpoint_spec(checkpoint_dir: os.PathLike) -> dict | None:
    """The run spec a checkpoint folder of the lab was trained with (its training_state.pt, memory-mapped: the
    optimizer state is not read); None for any other folder (an exported or downloaded model)."""
    import torch

    from training.checkpoint_files import STATE_FILE

    state = Path(checkpoint_dir) / STATE_FILE
    if not state.is_file():
        return None
    try:
        saved = torch.load(state, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # noqa: BLE001 - not a state file of ours, or one torch cannot map: no spec
        return None
    spec = saved.get("spec") if isinstance(saved, dict) else None
    return spec if isinstance(spec, dict) and isinstance(spec.get("data"), dict) else None


def heldout_cache_file(spec: dict) -> Path:
    """Where `plab eval` keeps a run's held-out text: PLAB_HOME/cache/heldout, named by what makes its tokens (the
    spec's data and model: the tokenizer may be the model's) and the window rule."""
    from training.config import RunSpec, plab_home

    rule = RunSpec.from_dict(spec, check_paths=False).data.val_windows
    key = hashlib.sha256(json.dumps({"data": spec.get("data"), "model": spec.get("model")}, sort_keys=True,
                                    default=str).encode()).hexdigest()[:24]
    return plab_home() / "cache" / "heldout" / f"{key}-{rule}.txt"
