"""Where user paths may point, and the error every spec problem raises. Below training.config and
training.corpus, which both need them (a module of its own so neither imports the other for them)."""
from __future__ import annotations

import os
from pathlib import Path


class SpecError(ValueError):
    """A run spec is invalid; the message says which field and how to fix it."""


def default_data_dir() -> Path:
    """The data directory when PLAB_DATA_DIR is unset: `shared/data` beside the checkout (a development
    checkout), else `data/` in it. The API, the workers and the CLI all use this one default."""
    repo = Path(__file__).resolve().parent.parent
    for candidate in (repo.parent / "shared" / "data", repo / "data"):
        if candidate.is_dir():
            return candidate
    return repo / "data"


def data_root() -> Path:
    return Path(os.environ["PLAB_DATA_DIR"]) if os.environ.get("PLAB_DATA_DIR") else default_data_dir()


CONFINE_ENV = "PLAB_CONFINE_PATHS"  # "1" in jobs a worker runs: user paths must lie inside the allowed roots


def allowed_roots() -> list[Path]:
    """Where paths that arrive through the API may point: the data directory and PLAB_ALLOWED_PATHS
    (os.pathsep-separated), resolved."""
    extra = [Path(p) for p in os.environ.get("PLAB_ALLOWED_PATHS", "").split(os.pathsep) if p.strip()]
    return [root.resolve() for root in [data_root(), *extra]]


def confine(value: str, field: str, roots: list[Path]) -> Path:
    """`value` (a name under the data directory, or a path) resolved – `..` and symlinks followed – and required
    to lie inside one of `roots`. The error says the same whatever exists outside them."""
    path = Path(value)
    resolved = (path if path.is_absolute() else roots[0] / path).resolve()
    for root in roots:
        if resolved == root or root in resolved.parents:
            return resolved
    raise SpecError(f"{field} must be a name or path inside the data directory or PLAB_ALLOWED_PATHS; got {value!r}")
