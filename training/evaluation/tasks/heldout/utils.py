"""Held-out text as lm-eval documents for loglikelihood_rolling."""

import re

import datasets

DOCUMENT_CHARS = 4096  # ~1k tokens: enough context per document, enough documents to pair


def split_into_documents(dataset: datasets.Dataset) -> datasets.Dataset:
    """Cut the text into consecutive documents of about DOCUMENT_CHARS, at line breaks.

    Line endings are normalised (corpora ship with CRLF) and a BOM is dropped, as the
    training tokenizer sees them. The documents concatenate back to the whole text.
    """
    text = "".join(dataset["text"]).replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
    documents, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        size += len(line)
        if size >= DOCUMENT_CHARS:
            documents.append("".join(current))
            current, size = [], 0
    if current and "".join(current).strip():
        documents.append("".join(current))
    return datasets.Dataset.from_dict({"text": documents})


def process_results(doc, results):
    (loglikelihood,) = results
    n_words = len(re.split(r"\s+", doc["text"].strip()))
    n_bytes = len(doc["text"].encode("utf-8"))
    return {
        "bits_per_byte": (loglikelihood, n_bytes),
        "byte_perplexity": (loglikelihood, n_bytes),
        "word_perplexity": (loglikelihood, n_words),
    }
