"""Downstream evaluation with lm-evaluation-harness: shipped offline tasks, per-sample results,
paired comparison against BF16.

- :func:`evaluate_checkpoint` runs lm-eval on an HF-format checkpoint and returns one JSON-able dict.
- :func:`list_tasks` lists shipped (``plab_*``), user (``PLAB_EVAL_TASKS_DIR``) and lm-eval tasks.
- :func:`compare_results` / :func:`paired_difference` (in :mod:`.stats`) give deltas with intervals.
- :func:`render_task_dirs` writes resolved task YAMLs for ``lm_eval --include_path``.
- :func:`main` is ``plab eval``.

lm-eval itself is imported lazily (it takes seconds), so importing this package is cheap.
"""

from .adapter import EvaluationError, evaluate_checkpoint, list_tasks, task_hash
from .cli import main
from .stats import compare_results, paired_difference
from .taskdirs import SHIPPED_TASKS, SHIPPED_TASKS_DIR, TaskConfigError, render_task_dirs

__all__ = [
    "SHIPPED_TASKS",
    "SHIPPED_TASKS_DIR",
    "EvaluationError",
    "TaskConfigError",
    "compare_results",
    "evaluate_checkpoint",
    "list_tasks",
    "main",
    "paired_difference",
    "render_task_dirs",
    "task_hash",
]
