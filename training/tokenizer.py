"""Tokenizers: a byte-level BPE trained on the corpus (`data.tokenizer: train`, cached on disk), or a local one
(`checkpoint`: model.init_from's folder; a tokenizer folder or tokenizer.json). Nothing is downloaded.

Trained BPE's cache key: SHA-256 of the corpus content (file names and bytes, in corpus order; for document
formats also the text field) + vocab size, so a changed corpus can never be served a stale tokenizer and
every recipe of an experiment shares one.
The BPE is trained on at most `TRAIN_BYTES` characters taken deterministically from the start of the
corpus: merges converge long before that on natural text, and it keeps training to seconds on CPU.
One special token, `<|endoftext|>`, serves as BOS, EOS and document separator (GPT-2 convention).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from training.corpus import Corpus, list_corpus_files

EOS_TOKEN = "<|endoftext|>"
TRAIN_BYTES = 16 * 2**20


def as_corpus(corpus) -> Corpus:
    """A Corpus, or a corpus folder/file/glob path read as one (text field "text")."""
    if isinstance(corpus, Corpus):
        return corpus
    path = Path(corpus)
    return Corpus(list_corpus_files(path), folder=path if path.is_dir() else None)


def corpus_hash(corpus) -> str:
    """Content hash of the corpus (names and raw bytes as stored, in corpus order)."""
    return as_corpus(corpus).content_hash()


def default_cache_dir() -> Path:
    from training.config import plab_home
    return plab_home() / "cache"


def _training_texts(corpus: Corpus, limit: int):
    """The first `limit` characters of the corpus in 64K-character pieces: a text file sliced as it streams
    in (the slices of the whole file's text), a document's text sliced alone."""
    used = 0
    for text in _documents_for_training(corpus):
        for start in range(0, len(text), 1 << 16):
            piece = text[start:start + (1 << 16)]
            yield piece
            used += len(piece)
            if used >= limit:
                return


def _documents_for_training(corpus: Corpus):
    if not corpus.text_only:
        yield from corpus.texts()
        return
    for path in corpus.files:  # a text file's pieces re-joined into 64K-aligned runs: the whole file's slices
        carry = ""
        for unit in Corpus([path]).units("train"):
            carry += unit.payload
            aligned = len(carry) - len(carry) % (1 << 16)
            if aligned:
                yield carry[:aligned]
                carry = carry[aligned:]
        yield carry


def _train_bpe(corpus: Corpus, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_training_texts(corpus, TRAIN_BYTES), trainer=trainer)
    return tok


def get_tokenizer(corpus, vocab_size: int, cache_dir=None) -> PreTrainedTokenizerFast:
    """The corpus's byte-level BPE tokenizer (trained once, then loaded from the cache). `corpus`: a Corpus or
    a corpus path."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 300:
        raise ValueError(f"vocab_size must be an integer >= 300 (256 byte symbols + merges), got {vocab_size!r}")
    corpus = as_corpus(corpus)
    path = tokenizer_cache_path(corpus, vocab_size, cache_dir)
    key = path.name
    if not (path / "tokenizer.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tok = _train_bpe(corpus, vocab_size)
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


def tokenizer_cache_path(corpus, vocab_size: int, cache_dir=None) -> Path:
    """Keyed by the corpus content (and, for document formats, the field the text is read from)."""
    corpus = as_corpus(corpus)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = corpus.content_hash()
    if not corpus.text_only:
        digest = hashlib.sha256(f"{digest}\0{corpus.text_field}".encode()).hexdigest()
    return cache_dir / "tokenizers" / f"{digest[:20]}-v{vocab_size}"


# End-of-text tokens of the common tokenizer families, for a bare tokenizer.json that names none.
CONVENTIONAL_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


def load_tokenizer(source: str, *, corpus=None, vocab_size: int | None = None, cache_dir=None,
                   init_from=None) -> PreTrainedTokenizerFast:
    """The tokenizer `data.tokenizer` names: "train" (the corpus's BPE, cached), "checkpoint" (the one in
    `model.init_from`'s folder) or a local tokenizer folder / tokenizer.json. Nothing is downloaded."""
    if source == "train":
        return get_tokenizer(corpus, vocab_size, cache_dir)
    if source == "checkpoint":
        if init_from is None:
            raise ValueError("data.tokenizer 'checkpoint' needs model.init_from (the checkpoint folder)")
        return local_tokenizer(Path(init_from), "the model.init_from checkpoint's tokenizer")
    return local_tokenizer(Path(source), "data.tokenizer")


def local_tokenizer(path: Path, what: str) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer

    if path.is_file():
        tok = PreTrainedTokenizerFast(tokenizer_file=str(path), model_max_length=1 << 30)
        if tok.eos_token is None:
            vocab = tok.get_vocab()
            found = next((t for t in CONVENTIONAL_EOS if t in vocab), None)
            if found is None:
                raise ValueError(f"{what} {str(path)!r} names no EOS token and has none of {list(CONVENTIONAL_EOS)}; "
                                 f"give its folder with a tokenizer_config.json that sets eos_token")
            tok.eos_token = found
        return tok
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ValueError(f"{what} {str(path)!r} holds no tokenizer (no tokenizer.json or tokenizer_config.json); "
                         f"give a tokenizer folder saved with save_pretrained, or a tokenizer.json file")
    try:
        if (path / "tokenizer.json").is_file():
            # The folder's tokenizer.json as it is: AutoTokenizer would pick the class of the folder's model type
            # (a Qwen2 checkpoint's Qwen2Tokenizer), which rebuilds the pipeline its own way and tokenized our
            # exported BPE differently from the run that trained it.
            tok = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what} {str(path)!r} could not be loaded: {exc}") from None
    if not tok.is_fast:
        raise ValueError(f"{what} {str(path)!r} has no fast (Rust) tokenizer; save it with tokenizer.json")
    tok.model_max_length = 1 << 30  # documents are packed, never truncated
    return tok
