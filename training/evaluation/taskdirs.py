"""Task directories: the shipped lm-eval task YAMLs, user task directories, and the render step.

lm-eval reads ``dataset_kwargs.data_files`` literally, so a YAML cannot say "relative to
PLAB_DATA_DIR". The shipped YAMLs are therefore templates with ``${NAME}`` placeholders, and
:func:`render_task_dirs` writes resolved copies (YAML and the ``.py`` files their ``!function``
tags import) into a directory that ``lm_eval --include_path`` or ``TaskManager(include_path=)``
reads. Placeholders:

- ``${PLAB_DATA_DIR}``: the data directory (argument, else the environment variable).
- ``${PLAB_EVAL_HELDOUT_TEXT}``: the held-out text for ``plab_heldout_bpb`` (argument, else
  the environment variable, else ``${PLAB_DATA_DIR}/tinyshakespeare/input.txt``).
- ``${TASK_DIR}``: the directory holding the source YAML, so a user task can ship its data
  next to its YAML.
- any other ``${NAME}``: the environment variable of that name.

Data files are never copied: rendered YAMLs point at the original files.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

SHIPPED_TASKS_DIR = Path(__file__).resolve().parent / "tasks"

#: The tasks `plab` evaluates by default, in display order (plab_blimp is a group of 67).
SHIPPED_TASKS = (
    "plab_blimp",
    "plab_lambada_openai",
    "plab_heldout_bpb",
    "plab_piqa",
    "plab_sciq",
    "plab_arc_easy",
    "plab_hellaswag",
)

DEFAULT_HELDOUT_RELPATH = "tinyshakespeare/input.txt"

_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class TaskConfigError(ValueError):
    """A task directory, task name or placeholder cannot be resolved; the message says how to fix it."""


def user_task_dirs(tasks_dir: str | os.PathLike | None = None) -> list[Path]:
    """The user task directories: ``tasks_dir`` if given, else ``PLAB_EVAL_TASKS_DIR``.

    Both may hold several directories separated by ``os.pathsep``. A named directory that
    does not exist is an error, not silently skipped, because the user expects its tasks.
    """
    raw = os.fspath(tasks_dir) if tasks_dir is not None else os.environ.get("PLAB_EVAL_TASKS_DIR", "")
    dirs = []
    for part in raw.split(os.pathsep):
        if not part.strip():
            continue
        path = Path(part).expanduser().resolve()
        if not path.is_dir():
            source = "tasks_dir" if tasks_dir is not None else "PLAB_EVAL_TASKS_DIR"
            raise TaskConfigError(
                f"{source} names {part!r}, which is not a directory; create it and put task "
                "YAML files in it, or unset it"
            )
        dirs.append(path)
    return dirs


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory: `data_dir` (--data-dir), else PLAB_DATA_DIR, else the default every other command uses
    (training.config.default_data_dir: `shared/data` beside the checkout, or `data/` in it)."""
    from training.config import default_data_dir

    if data_dir is not None:
        raw, named = os.fspath(data_dir), f"--data-dir {os.fspath(data_dir)!r}"
    elif os.environ.get("PLAB_DATA_DIR"):
        raw, named = os.environ["PLAB_DATA_DIR"], f"PLAB_DATA_DIR={os.environ['PLAB_DATA_DIR']!r}"
    else:
        raw = os.fspath(default_data_dir())
        named = f"the default data directory {raw!r} (PLAB_DATA_DIR is not set)"
    path = Path(raw).expanduser().resolve()
    if not path.is_dir():
        raise TaskConfigError(f"{named} is not a directory; point --data-dir or PLAB_DATA_DIR at the directory "
                              "holding blimp/, piqa/, lambada/, arc/, hellaswag/, sciq/")
    return path


def resolve_heldout_text(heldout_text: str | os.PathLike | None, data_dir: Path) -> Path:
    raw = os.fspath(heldout_text) if heldout_text is not None else os.environ.get("PLAB_EVAL_HELDOUT_TEXT")
    path = Path(raw).expanduser().resolve() if raw else data_dir / DEFAULT_HELDOUT_RELPATH
    if not path.is_file():
        raise TaskConfigError(
            f"held-out text {str(path)!r} is not a file; give --heldout-text (heldout_text= from Python) or set "
            "PLAB_EVAL_HELDOUT_TEXT to "
            "the experiment's validation text (plain, .gz or .bz2)"
        )
    return path


@dataclass
class RenderedTasks:
    """Where the rendered task directories are, ready for ``include_path``."""

    include_paths: list[Path]
    #: rendered YAML path -> placeholder names no value was found for
    unresolved: dict[Path, list[str]] = field(default_factory=dict)
    #: rendered YAML path -> the source YAML it came from
    sources: dict[Path, Path] = field(default_factory=dict)


def _is_yaml(path: Path) -> bool:
    # lm-eval's own templates are named "_template_yaml" (no dot) so its indexer skips them.
    return path.name.endswith("yaml") or path.suffix == ".yml"


def render_task_dirs(
    dest: str | os.PathLike,
    *,
    data_dir: str | os.PathLike | None = None,
    heldout_text: str | os.PathLike | None = None,
    tasks_dir: str | os.PathLike | None = None,
) -> RenderedTasks:
    """Render the shipped tasks and the user task directories into ``dest``.

    ``dest/plab`` receives the shipped tasks, ``dest/user<i>`` each user directory. The
    result's ``include_paths`` go to ``lm_eval --include_path`` (joined by commas) or
    ``TaskManager(include_path=...)``; later paths override earlier ones on a name clash.
    """
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise TaskConfigError(f"render destination {str(dest)!r} is not empty; give a new or empty directory")
    data = resolve_data_dir(data_dir)
    values = {
        "PLAB_DATA_DIR": str(data),
        "PLAB_EVAL_HELDOUT_TEXT": str(resolve_heldout_text(heldout_text, data)),
    }
    rendered = RenderedTasks(include_paths=[])
    sources = [(SHIPPED_TASKS_DIR, dest / "plab")]
    sources += [(src, dest / f"user{i}") for i, src in enumerate(user_task_dirs(tasks_dir))]
    for src_root, out_root in sources:
        for src in sorted(src_root.rglob("*")):
            if not src.is_file() or "__pycache__" in src.parts:
                continue
            out = out_root / src.relative_to(src_root)
            if _is_yaml(src):
                out.parent.mkdir(parents=True, exist_ok=True)
                text, missing = _substitute(src.read_text(encoding="utf-8"), {**values, "TASK_DIR": str(src.parent)})
                out.write_text(text, encoding="utf-8")
                rendered.sources[out] = src
                if missing:
                    rendered.unresolved[out] = missing
            elif src.suffix == ".py":
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, out)
        out_root.mkdir(parents=True, exist_ok=True)
        rendered.include_paths.append(out_root)
    return rendered


def _substitute(text: str, values: dict[str, str]) -> tuple[str, list[str]]:
    missing: list[str] = []

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name in values:
            return values[name]
        if name in os.environ:
            return os.environ[name]
        missing.append(name)
        return match.group(0)

    return _PLACEHOLDER.sub(replace, text), missing


_TASK_LINE = re.compile(r"^(?:task|group|tag):\s*['\"]?([A-Za-z0-9_.:\-]+)", re.M)
# A tag (or group) given as a list: "tag:" then "  - name" lines.
_LIST_KEY = re.compile(r"^(?:tag|group):\s*$\n((?:[ \t]+-[ \t]*['\"]?[A-Za-z0-9_.:\-]+['\"]?[ \t]*\n?)+)", re.M)
_LIST_ITEM = re.compile(r"-[ \t]*['\"]?([A-Za-z0-9_.:\-]+)")


def known_task_names(tasks_dir: str | os.PathLike | None = None) -> frozenset[str]:
    """Every task, group and tag name a YAML declares – shipped, user (`PLAB_EVAL_TASKS_DIR`) and lm-eval's own –
    read as text, without importing lm_eval (the API checks an experiment's `eval_tasks` with it)."""
    roots = [SHIPPED_TASKS_DIR, *user_task_dirs(tasks_dir)]
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is not None and spec.submodule_search_locations:
        roots.append(Path(list(spec.submodule_search_locations)[0]) / "tasks")
    return _scan(tuple(str(r) for r in roots))


@functools.lru_cache(maxsize=8)
def _scan(roots: tuple[str, ...]) -> frozenset[str]:
    names: set[str] = set()
    for root in roots:
        for path in Path(root).rglob("*.yaml"):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            names.update(_TASK_LINE.findall(text))
            for block in _LIST_KEY.findall(text):
                names.update(_LIST_ITEM.findall(block))
    return frozenset(names)
