"""What the `plab` commands share: the error a user can act on, and reading their YAML/JSON files."""
from __future__ import annotations

import argparse
import functools
import json
import os
from contextlib import contextmanager
from pathlib import Path


class UsageError(Exception):
    """A problem with what the user typed or wrote in a file; printed without a traceback."""


# YAML 1.1 (PyYAML) reads 3e-4 or 1e5 as strings: a float needs a dot there ("3.0e-4"), which is not how learning
# rates are written. YAML 1.2's float, which takes them as numbers, added to the safe loader's resolvers.
_YAML12_FLOAT = r"""^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"""


@functools.cache
def _yaml_loader():
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_YAML12_FLOAT), list("-+0123456789"))
    return Loader


def load_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{path}: no such file")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        raise UsageError(f"{path}: not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: {e}") from e
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def whole_number(minimum: int = 1):
    """An argparse type: an integer >= `minimum`, refused with what was typed."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
        return value
    parse.__name__ = f"whole number >= {minimum}"
    return parse


def document_limit(text: str) -> int | float:
    """An argparse type for an evaluation's --limit (training.evaluation.limits' rule, as lm-eval's --limit)."""
    from training.evaluation.limits import document_limit_arg  # here: the evaluation package imports numpy

    return document_limit_arg(text)


document_limit.__name__ = "document limit"


def port_number(text: str, source: str = "") -> int:
    """A TCP port, 1-65535 (argparse type; `source` names an environment variable the value came from)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= 65535:
        where = f"{source} " if source else ""
        raise argparse.ArgumentTypeError(f"{where}must be a port number from 1 to 65535, got {text!r}")
    return value


def port_from_env(variable: str, default: int) -> int:
    """The port an environment variable sets, read when a command runs (an unset one: `default`)."""
    text = os.environ.get(variable)
    if text is None or text == "":
        return default
    try:
        return port_number(text, variable)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"{e}: unset it or give --port") from None


@contextmanager
def api_call(url: str, what: str):
    """Errors of a call to the API as a UsageError: the server's refusal (`what` was refused: its reason) or a
    server that cannot be reached (where, and how to start one)."""
    import httpx

    from workers.client import ApiError

    try:
        yield
    except ApiError as e:
        raise UsageError(f"the server refused {what}: {e.message}") from e
    except httpx.HTTPError as e:
        raise UsageError(f"cannot reach the API at {url} ({e}); start it with `plab serve`, or give --api-url / "
                         f"set PLAB_API_URL") from e
