"""Serving a run's artifacts (checkpoints, logs) for download, confined to the run's own folder.

An artifact's path is whatever a worker or a user's script recorded, so it is never trusted: it is resolved
(symbolic links and `..` followed) and served only when the result lies inside PLAB_HOME/runs/<run id>. A checkpoint
is a folder (Hugging Face format); it streams as an uncompressed tar built on the fly (safetensors do not compress,
and nothing is staged on disk), holding only the regular files that also resolve inside the run's folder: a link
inside a checkpoint cannot pull in a file from elsewhere either.
"""
from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

from backend.errors import Conflict, Forbidden, NotFound
from backend.models import Artifact
from backend.services.housekeeping import run_folder
from plab.settings import home_path

CHUNK = 1 << 20
BLOCK = 512  # tar's record unit


def confined_path(session, home: Path, run_id: int, artifact_id: int) -> Path:
    """The artifact's file or folder on this machine, guaranteed inside the run's folder."""
    art = session.get(Artifact, artifact_id)
    if art is None or art.run_id != run_id:
        raise NotFound(f"run {run_id} has no artifact {artifact_id}")
    if "://" in art.path:
        raise Conflict(f"artifact {artifact_id} is stored at a URL ({art.path}); download it from there")
    folder = run_folder(home, run_id)
    try:
        target = home_path(art.path, home).resolve(strict=True)
    except (OSError, RuntimeError):
        raise NotFound(f"artifact {artifact_id} is no longer on disk (a run keeps only its newest checkpoints; "
                       "record-only runs keep theirs where their script wrote them)") from None
    if not target.is_relative_to(folder):
        raise Forbidden(f"artifact {artifact_id} lies outside run {run_id}'s folder (PLAB_HOME/runs/{run_id}); "
                        "only files inside it are served")
    return target


def folder_files(root: Path, confine: Path) -> list[tuple[Path, str]]:
    """(path, name inside the archive) of every regular file under `root` that resolves inside `confine`, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            try:
                real = path.resolve(strict=True)
            except (OSError, RuntimeError):
                continue
            if real.is_relative_to(confine) and real.is_file():
                out.append((real, f"{root.name}/{path.relative_to(root).as_posix()}"))
    return out


def tar_stream(files: list[tuple[Path, str]]) -> Iterator[bytes]:
    """A POSIX tar of `files`, produced chunk by chunk. A file that changes size while it is read is cut or
    zero-padded to the size its header announced, so the archive stays well-formed."""
    for path, name in files:
        try:
            f = open(path, "rb")
        except OSError:
            continue
        with f:
            st = os.fstat(f.fileno())
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o644
            yield info.tobuf(format=tarfile.PAX_FORMAT)
            left = st.st_size
            while left > 0:
                data = f.read(min(CHUNK, left)) or b"\0" * min(CHUNK, left)
                left -= len(data)
                yield data
        yield b"\0" * (-st.st_size % BLOCK)
    yield b"\0" * (2 * BLOCK)
