"""What every benchmark result records about the code it measured."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit(repo: Path | None = None) -> str:
    """HEAD's sha, with "-dirty" when tracked files differ from it; PLAB_GIT_COMMIT names it for a copy of the tree
    without .git (the GPU machine). A copy whose .git is older than its files (seen on the GPU machine, 2026-11-29:
    HEAD said 426c869 for a tree at 2e813b0) so reads as HEAD-dirty, not as HEAD."""
    if os.environ.get("PLAB_GIT_COMMIT"):
        return os.environ["PLAB_GIT_COMMIT"]
    cwd = repo or REPO
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=cwd,
                             timeout=10).stdout.strip()
        if not sha:
            return "unknown"
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, cwd=cwd, timeout=30)
        return sha + ("-dirty" if changed.returncode == 0 and changed.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_result(summary: dict, bench: str, device_name: str, results_dir: Path | None = None) -> list[Path]:
    """`summary` as JSON in bench/results/<bench>_<device>_<UTC time>.json (or in `results_dir`) and, when $OUT is
    set (the GPU machine), as $OUT/<bench>.json; prints and returns the paths."""
    import datetime as dt
    import json

    text = json.dumps(summary, indent=1)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    paths = [(results_dir or REPO / "bench" / "results") / f"{bench}_{slug}_{stamp}.json"]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / f"{bench}.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return paths
