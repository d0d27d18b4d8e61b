"""Loader for the plain-text HellaSwag rendering (llama.cpp's hellaswag_val_full.txt)."""

import bz2
import gzip
import re

import datasets

LINES_PER_ITEM = 6  # context, gold index, then the four endings


def preprocess(text):
    """lm-eval's hellaswag `preprocess` (lm_eval/tasks/hellaswag/utils.py, applied there to the query and every
    ending): WikiHow's bracketed markup out, " [title]" as a sentence end, double spaces single."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def load_hellaswag_text(text_file, **_metadata):
    """Parse 6-line records into lm-eval docs ``{query, choices, label}``.

    The file is split on ``\\n`` only: endings are free text, and a universal-newline split
    could cut one in two and shift every later record.
    """
    opener = bz2.open if str(text_file).endswith(".bz2") else gzip.open if str(text_file).endswith(".gz") else open
    with opener(text_file, "rb") as fh:
        lines = fh.read().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % LINES_PER_ITEM:
        raise ValueError(
            f"{text_file}: {len(lines)} lines is not a multiple of {LINES_PER_ITEM}; "
            "expected the hellaswag_val_full.txt layout (context, gold index, 4 endings)"
        )
    docs = []
    for start in range(0, len(lines), LINES_PER_ITEM):
        query, gold, *endings = lines[start:start + LINES_PER_ITEM]
        docs.append({"query": preprocess(query), "choices": [preprocess(e) for e in endings], "label": int(gold)})
    return {"validation": datasets.Dataset.from_list(docs)}
