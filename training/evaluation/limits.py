"""An evaluation's document limit, as lm-eval's ``--limit``: one rule for every place that takes one (``plab eval``
on a checkpoint or on a run, the REST API, :func:`evaluate_checkpoint`).

A limit is a whole number of documents per task (1 to :data:`MAX_EVAL_DOCS`) or a fraction of each task's documents
strictly between 0 and 1. A float without a fractional part is the whole number (``2.0`` is 2, as JSON Schema's
"integer" reads it); booleans, strings, NaN and infinities are refused.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

MAX_EVAL_DOCS = 1_000_000

RULE = (f"limit must be a whole number of documents per task (1 to {MAX_EVAL_DOCS:,}) or a fraction of each task's "
        f"documents between 0 and 1 such as 0.1 (lm-eval's --limit)")


def document_limit(value: Any, shown: str | None = None) -> int | float | None:
    """`value` as a limit (None: every document), or ValueError naming the rule and `shown` (default: repr(value))."""
    if value is None:
        return None
    if type(value) is float and math.isfinite(value) and value.is_integer():
        value = int(value)
    if type(value) is int and 1 <= value <= MAX_EVAL_DOCS:
        return value
    if type(value) is float and 0 < value < 1:
        return value
    raise ValueError(f"{RULE}, got {shown if shown is not None else repr(value)}")


def document_limit_arg(text: str) -> int | float:
    """An argparse type: a limit typed on a command line ("50", "0.1", "1e3"), refused with the rule and what was
    typed."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    try:
        return document_limit(value, shown=repr(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
