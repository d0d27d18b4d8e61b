"""Byte-level BPE tokenizer trained on the corpus with the `tokenizers` library, cached on disk.

Cache key: SHA-256 of the corpus content (file names and bytes, in sorted order) + vocab size, so a
changed corpus can never be served a stale tokenizer and every recipe of an experiment shares one.
The BPE is trained on at most `TRAIN_BYTES` bytes taken deterministically from the start of the
sorted files: merges converge long before that on natural text, and it keeps training to seconds on CPU.
One special token, `<|endoftext|>`, serves as BOS, EOS and document separator (GPT-2 convention).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
TRAIN_BYTES = 16 * 2**20
CORPUS_SUFFIXES = (".txt", ".txt.gz", ".text", ".text.gz")


def corpus_files(corpus_dir: str | os.PathLike) -> list[Path]:
    """The text files of a corpus, sorted by name (the order fixes the token stream).

    Only `*.txt`/`*.text` (optionally gzipped) count, so provenance notes such as SOURCE.md stay out.
    """
    root = Path(corpus_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory {str(root)!r} does not exist; set PLAB_DATA_DIR or give "
                                f"an absolute path")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(CORPUS_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"corpus directory {str(root)!r} has no text files ending in "
                                f"{', '.join(CORPUS_SUFFIXES)}")
    return files


def read_text(path: Path) -> str:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def corpus_hash(corpus_dir: str | os.PathLike) -> str:
    """Content hash of the corpus (names and raw bytes as stored, in sorted order)."""
    h = hashlib.sha256()
    for p in corpus_files(corpus_dir):
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def default_cache_dir() -> Path:
    from training.config import plab_home
    return plab_home() / "cache"


def _training_texts(corpus_dir, limit: int):
    used = 0
    for p in corpus_files(corpus_dir):
        text = read_text(p)
        for start in range(0, len(text), 1 << 16):
            piece = text[start:start + (1 << 16)]
            yield piece
            used += len(piece)
            if used >= limit:
                return


def _train_bpe(corpus_dir, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_training_texts(corpus_dir, TRAIN_BYTES), trainer=trainer)
    return tok


def get_tokenizer(corpus_dir, vocab_size: int, cache_dir=None) -> PreTrainedTokenizerFast:
    """The corpus's byte-level BPE tokenizer (trained once, then loaded from the cache)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 300:
        raise ValueError(f"vocab_size must be an integer >= 300 (256 byte symbols + merges), got {vocab_size!r}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = f"{corpus_hash(corpus_dir)[:20]}-v{vocab_size}"
    path = cache_dir / "tokenizers" / key
    if not (path / "tokenizer.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tok = _train_bpe(corpus_dir, vocab_size)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                       unk_token=None, model_max_length=1 << 30)
        # Write to a temp dir and rename, so two workers racing (or a kill mid-write) never leave a
        # half-written tokenizer in the cache.
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=path.parent))
        fast.save_pretrained(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race: its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def tokenizer_cache_path(corpus_dir, vocab_size: int, cache_dir=None) -> Path:
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cache_dir / "tokenizers" / f"{corpus_hash(corpus_dir)[:20]}-v{vocab_size}"
