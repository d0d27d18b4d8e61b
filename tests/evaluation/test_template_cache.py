"""lm-eval's templates compiled once per evaluation process (`adapter._compile_templates_once`): every shipped
task's prompts, targets and choices are the same strings as with lm-eval's own `apply_template`, and each
distinct template is compiled once instead of once per document."""

from __future__ import annotations

import os
from pathlib import Path

from training.evaluation import SHIPPED_TASKS, render_task_dirs
from training.evaluation.adapter import _compile_templates_once, _lm_eval_environment

DATA_DIR = Path(os.environ["PLAB_DATA_DIR"])
DOCS = 40  # per task, per BLiMP paradigm


def _rendered(task, docs) -> list:
    out = []
    for doc in docs:
        out.append((task.doc_to_text(doc), task.doc_to_target(doc),
                    task.doc_to_choice(doc) if task.config.doc_to_choice is not None else None))
    return out


def test_every_shipped_task_renders_the_same_strings_with_each_template_compiled_once(tmp_path, monkeypatch):
    from lm_eval import utils
    from lm_eval.tasks import TaskManager

    with _lm_eval_environment(offline=True):
        rendered = render_task_dirs(tmp_path / "tasks", data_dir=DATA_DIR)
        manager = TaskManager(include_path=[str(p) for p in rendered.include_paths], include_defaults=False)
        tasks = manager.load(list(SHIPPED_TASKS))["tasks"]
        docs = {name: list(t.eval_docs)[:DOCS] for name, t in tasks.items()}

        cached = utils.apply_template
        assert getattr(cached, "plab_compiles_once", False), "an evaluation environment installs the cache"
        _compile_templates_once()
        assert utils.apply_template is cached, "installed once per process"
        compiles = []
        real_from_string = utils.env.from_string
        monkeypatch.setattr(utils.env, "from_string", lambda *a, **k: compiles.append(a[0]) or real_from_string(*a, **k))

        monkeypatch.setattr(utils, "apply_template", cached.original)
        plain = {name: _rendered(t, docs[name]) for name, t in tasks.items()}
        compiled_plain = len(compiles)
        compiles.clear()
        monkeypatch.setattr(utils, "apply_template", cached)
        fast = {name: _rendered(t, docs[name]) for name, t in tasks.items()}

    assert len(tasks) >= 67 + 6 and all(docs.values())  # every BLiMP paradigm and the other shipped tasks
    assert fast == plain
    # Templates compiled before this test (while the tasks were built) are already in the cache, so at most
    # one compile per distinct template; without the cache, one per document and field.
    assert len(compiles) == len(set(compiles))
    assert len(compiles) < compiled_plain / 10, (len(compiles), compiled_plain)
    assert compiled_plain > 1000
