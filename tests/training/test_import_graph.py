"""training/ is a library below everything else: no import circle among its modules, and nothing imported
from the packages above it or from web/database/queue libraries. Imports inside functions count too: a
circle that only closes at call time still ties the modules together."""
import ast
from pathlib import Path

import training

ROOT = Path(training.__file__).resolve().parent
FORBIDDEN = {"backend", "workers", "frontend", "fastapi", "starlette", "sqlalchemy", "alembic", "celery",
             "kombu", "redis", "httpx", "requests", "uvicorn", "psycopg", "pydantic", "pydantic_settings"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ["training", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Absolute names of what `path` imports (relative imports resolved); `from a.b import c` names the
    module a.b.c where there is one, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(name, path, modules) if m in modules} - {name}
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_circle_among_the_training_modules():
    graph = _graph()
    assert {"training.train", "training.setup", "training.launch", "training.distributed"} <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_training_imports_nothing_from_the_packages_above_it():
    modules = _modules()
    offenders = sorted(f"{path.relative_to(ROOT.parent)}: {imported}"
                       for name, path in modules.items() for imported in _imports(name, path, modules)
                       if imported.split(".")[0] in FORBIDDEN)
    assert offenders == []
