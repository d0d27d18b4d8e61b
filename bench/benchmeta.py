"""What every benchmark result records about the code it measured."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """HEAD's sha; PLAB_GIT_COMMIT names it for a copy of the tree without .git (the GPU machine)."""
    if os.environ.get("PLAB_GIT_COMMIT"):
        return os.environ["PLAB_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
