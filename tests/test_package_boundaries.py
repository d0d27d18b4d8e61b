"""The packages' import boundaries: backend/ and workers/ never import each other (what they share lives in
plab.settings, plab.broker and plab.claims, which import neither), and nothing below the command line imports plab.cli.
Every import statement counts, including the ones inside functions."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

FORBIDDEN = {
    "backend": ("workers", "plab.cli"),
    "workers": ("backend", "plab.cli"),
    "plab/settings.py": ("backend", "workers", "plab.cli"),
    "plab/broker.py": ("backend", "workers", "plab.cli"),
    "plab/claims.py": ("backend", "workers", "plab.cli"),
}


def imported_modules(path: Path, repo: Path) -> list[tuple[int, str]]:
    """Every module an import statement of `path` names, with its line (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(repo).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found += [(node.lineno, f"{base}.{alias.name}" if base else alias.name) for alias in node.names]
    return found


def violations(where: str, forbidden: tuple[str, ...], repo: Path = REPO) -> list[str]:
    root = repo / where
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    out = []
    for path in files:
        for line, module in imported_modules(path, repo):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(repo)}:{line} imports {module}")
    return out


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_a_package_imports_nothing_across_its_boundary(where):
    assert violations(where, FORBIDDEN[where]) == []


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    # The check must not be a check that cannot fail: a lazy cross import in a throw-away module is found.
    fake = tmp_path / "workers"
    fake.mkdir()
    (fake / "job.py").write_text("def f():\n    from backend.settings import get_settings\n    from . import x\n")
    assert violations("workers", ("backend",), tmp_path) == ["workers/job.py:2 imports backend.settings.get_settings"]


@pytest.mark.parametrize("entry, other", [("workers.tasks", "backend"), ("backend.app", "workers")])
def test_loading_one_side_loads_nothing_of_the_other(entry, other):
    """What the worker and the API processes load at start, checked in a fresh interpreter."""
    code = (f"import sys, {entry}; "
            f"print(sorted(m for m in sys.modules if m == '{other}' or m.startswith('{other}.')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_no_function_in_training_backend_or_workers_is_over_80_lines():
    import ast

    repo = Path(__file__).resolve().parents[1]
    long = [f"{path.relative_to(repo)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for top in ("training", "backend", "workers", "plab") for path in sorted((repo / top).rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80]
    assert long == [], "split these:\n" + "\n".join(long)
