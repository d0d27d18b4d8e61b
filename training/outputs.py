"""Where a command will write (a folder, a file), checked before the work starts. No torch."""
from __future__ import annotations

import os
from pathlib import Path


def output_problem(path, *, folder: bool) -> str | None:
    """Why a command could not write to `path` (a folder, or a file's folder: created now, as the work would), or None;
    asked before the work starts, so a typo in a path is not found after the model is built or evaluated."""
    path = Path(path)
    target = path if folder else path.parent
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create the folder {target} ({e.strerror or e})"
    if not target.is_dir():
        return f"{target} is not a folder"
    if not os.access(target, os.W_OK | os.X_OK):
        return f"the folder {target} is not writable"
    if not folder and path.is_dir():
        return f"{path} is a folder; give a file name"
    return None


def outputs_problem(outputs) -> str | None:
    """The first of `outputs` ((flag, path or None, is a folder) triples) a command could not write, said as
    "FLAG PATH: why", or None."""
    for flag, path, folder in outputs:
        problem = output_problem(path, folder=folder) if path else None
        if problem:
            return f"{flag} {path}: {problem}"
    return None
