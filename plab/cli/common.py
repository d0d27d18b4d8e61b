"""What the `plab` commands share: the error a user can act on, and reading their YAML/JSON files."""
from __future__ import annotations

import json
from pathlib import Path


class UsageError(Exception):
    """A problem with what the user typed or wrote in a file; printed without a traceback."""


def load_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{path}: no such file")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        raise UsageError(f"{path}: not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: {e}") from e
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
