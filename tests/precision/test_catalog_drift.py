"""No hand-kept list of recipe or GEMM format names outside the catalog: the consumers read it (their tests are
in test_catalog.py, tests/backend/test_recipes_api.py and tests/gemm/test_recipe_gemm_ops.py), and this scan of the
repository's Python, JavaScript and templates fails on a literal that copies the catalog's names or names a
recipe the catalog does not have."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from training.precision import catalog

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("backend", "bench", "frontend", "plab", "scripts", "training", "workers")
RECIPE_LIKE = re.compile(r"^(bf16|fp8_[a-z]+|mxfp\d\w*|nvfp\d\w*)$")
# A literal that lists every recipe (or every format) is a copy; these are deliberate and say why.
ALLOWED = {
    "training/precision/formats.py": "the number formats of quantize_dequantize (ARCHITECTURE.md's contract)",
}


def _python_groups(text: str):
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        strings = [n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        if strings:
            yield node.lineno, strings


_JS_GROUP = re.compile(r"\[[^\[\]]*\]|\{[^{}]*\}", re.S)
_JS_STRING = re.compile(r"""["']([A-Za-z0-9_]+)["']|\b([A-Za-z_][A-Za-z0-9_]*)\s*:""")


def _js_groups(text: str):
    for match in _JS_GROUP.finditer(text):
        strings = [a or b for a, b in _JS_STRING.findall(match.group())]
        if strings:
            yield text.count("\n", 0, match.start()) + 1, strings


def _groups():
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*")):
            rel = path.relative_to(REPO).as_posix()
            if "/results/" in rel or not path.is_file():
                continue
            if path.suffix == ".py":
                yield from ((rel, line, s) for line, s in _python_groups(path.read_text()))
            elif path.suffix in (".js", ".html"):
                yield from ((rel, line, s) for line, s in _js_groups(path.read_text()))


def test_no_literal_copies_the_catalogs_recipe_or_format_names():
    names, formats = set(catalog.recipe_names()), set(catalog.gemm_formats())
    complete = [names, names - {catalog.BASELINE}, formats, formats - {catalog.BASELINE}]
    copies = [f"{rel}:{line}: {strings}" for rel, line, strings in _groups()
              if rel not in ALLOWED and any(full <= set(strings) for full in complete)]
    assert copies == [], "read training.precision.catalog (or GET /api/v1/recipes) instead of listing names:\n" + \
        "\n".join(copies)


def test_every_recipe_name_in_a_literal_list_is_in_the_catalog():
    known = set(catalog.recipe_names()) | set(catalog.gemm_formats())
    stale = []
    for rel, line, strings in _groups():
        recipe_like = [s for s in strings if RECIPE_LIKE.match(s)]
        if len(recipe_like) >= 2:
            stale += [f"{rel}:{line}: {s!r}" for s in recipe_like if s not in known]
    assert stale == [], "names that are not catalog recipes:\n" + "\n".join(stale)
