"""A run's held-out text for the held-out bits-per-byte task (plab_heldout_bpb), made from its own validation split,
and the context it trained its model on: from the run spec, which the worker has from the API and `plab eval` finds in
a checkpoint folder of the lab (its run_spec.json), so a figure by hand is the worker's figure."""
from __future__ import annotations

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


def validation_text(spec: dict, out: os.PathLike | None = None, max_tokens: int = 400_000) -> str | None:
    """The experiment's held-out text (the validation split the loop reports val/loss on), decoded from its
    token shard, for the held-out bits-per-byte task, into the file `out` (kept: made once): under data.val_windows
    "spread", `heldout_slices` of it, its pieces and documents joined by a blank line; under "first" (runs stored
    before the rule existed), its first `max_tokens` decoded as they always were (separators' text included), so
    their results stay paired with earlier ones. None for synthetic corpora.

    Without `out` (`plab eval`), the text is kept in PLAB_HOME/cache/heldout under the name of the token cache it is
    decoded from (whose key names the corpus's content, the tokenizer and the split) and the window rule: a changed
    corpus or tokenizer gets a text of its own, never an older one. Opening the data tokenizes the corpus where this
    machine has no token cache of it yet."""
    from training.config import RANDOM_CORPUS, RunSpec, plab_home
    from training.setup import open_token_dataset

    rs = RunSpec.from_dict(spec)
    if rs.data.corpus == RANDOM_CORPUS:
        return None
    if out is not None and Path(out).is_file():
        return str(out)
    tok, ds = open_token_dataset(rs, plab_home() / "cache")
    if out is None:
        out = plab_home() / "cache" / "heldout" / f"{ds.info['cache']}-{rs.data.val_windows}-{max_tokens}.txt"
    out = Path(out)
    if not out.is_file():
        _write_text(tok, ds, rs.data.val_windows, out, max_tokens)
    return str(out)


def _write_text(tok, ds, rule: str, out: Path, max_tokens: int) -> None:
    """The text into `out` through a temporary file of its own (two evaluations making it at once each rename a
    whole file into place)."""
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    if rule == "first":  # the text as it always was, byte for byte: results stay paired
        text = tok.decode(ds.val[:max_tokens].tolist())
    else:
        pieces = heldout_slices(len(ds.val), max_tokens, rule)
        text = "\n\n".join(documents_text(tok, ds.val[piece].tolist()) for piece in pieces)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    """The run spec a checkpoint folder of the lab was trained with (its run_spec.json, written beside the weights
    since 2026-11-30); None for any other folder, and for older checkpoints of the lab: their spec is only in the
    pickled training_state.pt, which is not unpickled for an evaluation (a folder from elsewhere could run code)."""
    from training.checkpoint_files import RUN_SPEC_FILE

    path = Path(checkpoint_dir) / RUN_SPEC_FILE
    try:
        spec = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return spec if isinstance(spec, dict) and isinstance(spec.get("data"), dict) else None
