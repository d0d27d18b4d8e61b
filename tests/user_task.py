"""A user's own evaluation task as a user writes one: a YAML and its JSONL dropped into a folder that
PLAB_EVAL_TASKS_DIR names (six multiple-choice questions, so an evaluation of it takes seconds)."""
from __future__ import annotations

import json
from pathlib import Path

NAME = "my_capitals"

CAPITALS = [
    ("France", "Paris", "Rome"),
    ("Italy", "Rome", "Paris"),
    ("Spain", "Madrid", "Lisbon"),
    ("Portugal", "Lisbon", "Madrid"),
    ("Germany", "Berlin", "Vienna"),
    ("Austria", "Vienna", "Berlin"),
]

USER_TASK_YAML = """\
task: my_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: ${TASK_DIR}/capitals.jsonl
output_type: multiple_choice
test_split: test
doc_to_text: "The capital of {{country}} is"
doc_to_choice: "{{[right, wrong]}}"
doc_to_target: 0
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_user_task(tasks_dir: Path) -> Path:
    """The task's YAML and data in `tasks_dir` (made if missing); returns the folder."""
    tasks_dir.mkdir(parents=True, exist_ok=True)
    (tasks_dir / f"{NAME}.yaml").write_text(USER_TASK_YAML)
    with open(tasks_dir / "capitals.jsonl", "w") as fh:
        for country, right, wrong in CAPITALS:
            fh.write(json.dumps({"country": country, "right": right, "wrong": wrong}) + "\n")
    return tasks_dir
