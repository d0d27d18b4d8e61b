"""Loader for PIQA's official release format (questions JSONL + a parallel labels file)."""

import json

import datasets


def load_piqa(questions_file, labels_file, **_metadata):
    """Join valid.jsonl with valid-labels.lst line by line into lm-eval's doc shape.

    lm-eval calls a task's custom_dataset with the task metadata as keyword arguments too,
    hence ``**_metadata``.
    """
    with open(questions_file, encoding="utf-8") as fh:
        questions = [json.loads(line) for line in fh if line.strip()]
    with open(labels_file, encoding="utf-8") as fh:
        labels = [int(line) for line in fh if line.strip()]
    if len(questions) != len(labels):
        raise ValueError(
            f"PIQA files do not align: {questions_file} has {len(questions)} questions but "
            f"{labels_file} has {len(labels)} labels; use the matching pair from the same release"
        )
    docs = [
        {"goal": q["goal"], "sol1": q["sol1"], "sol2": q["sol2"], "label": label}
        for q, label in zip(questions, labels)
    ]
    return {"validation": datasets.Dataset.from_list(docs)}
