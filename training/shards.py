"""Token shards built from a corpus: streamed, on every core, cached, safe against a second builder.

`build_token_shards` writes `train.bin` / `val.bin` (numpy memmaps of token ids) and `meta.json` into
`cache_dir/shards/<key>`, the key a hash of the corpus content, the tokenizer and the settings that change
the tokens. Two jobs asking for the same shards at once: one builds under an exclusive file lock, the other
waits on the lock and then reads what the first wrote; the shards are written into a temporary folder that
is renamed into place, so a killed build never leaves a half-written cache.

Packing: every document is `[BOS] tokens EOS` (BOS only where the tokenizer's own template adds one),
documents back to back in corpus order. Held out for validation: a given `val_corpus`, else for document
formats (JSONL, Parquet, Arrow) the documents whose content hash falls below `val_fraction` - whole
documents, the same ones in any format and any file order, and duplicates on one side - and for text files
(one document each) the last `val_fraction` of each file's tokens, as the lab always did. With
`eos_at_split` (data.eos_at_split, the default for new runs) a text file's training part ends with EOS where
its tail was cut off; without it (every run before the key existed) it runs on into the next file's first token.

Parallel: `num_proc` processes each encode a unit (about 1 MB of text) at a time; the reading process only
moves bytes, keeps at most `2 * num_proc + 2` units in flight and writes results in order, so memory does not
grow with the corpus and the token stream does not depend on `num_proc`.
"""
from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from training.corpus import (Corpus, CorpusError, Unit, file_format, parse_json_lines, shared_files, table_texts,
                             text_pieces)

SHARD_FORMAT_VERSION = 2
LEGACY_FORMAT_VERSION = 1  # text folders with the corpus-trained BPE keep their cache keys and bytes
BAD_EXAMPLES = 5
PROGRESS_EVERY_S = 2.0


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size < 2**16 else np.uint32


def default_num_proc() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def special_token_ids(tokenizer) -> tuple[int | None, int]:
    """(BOS id or None, EOS id): BOS only when the tokenizer's own template puts it before a text (Llama's
    does; GPT-2-style and Qwen's do not), so documents are packed the way the model was trained."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise CorpusError("the tokenizer names no EOS token, which separates packed documents; use a tokenizer "
                          "folder whose tokenizer_config.json sets eos_token")
    bos = tokenizer.bos_token_id
    if bos is not None and tokenizer("x")["input_ids"][:1] != [bos]:
        bos = None
    return bos, eos


def tokenizer_fingerprint(tokenizer) -> str:
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


# ---- the worker side ----------------------------------------------------------------------------------------
@dataclass
class EncoderConfig:
    tokenizer_json: str
    bos: int | None
    eos: int
    dtype: str
    text_field: str
    val_fraction: float
    names: list[str]


@dataclass
class Encoded:
    train: np.ndarray
    val: np.ndarray
    docs_train: int = 0
    docs_val: int = 0
    rows: int = 0                               # lines/rows read (documents and bad lines)
    bad: list[str] = field(default_factory=list)
    # With data.val_corpus: each whole document's content hash (`document_hash`), so validation documents that
    # the training corpus repeats are counted (ShardWriter.overlap); empty otherwise.
    hashes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))


_worker: tuple | None = None  # (tokenizers.Tokenizer, EncoderConfig) of this process


def init_encoder(config: EncoderConfig, in_pool: bool = True) -> None:
    global _worker
    if in_pool:  # one thread per process: the processes are the parallelism
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer
    _worker = (Tokenizer.from_str(config.tokenizer_json), config)


def document_hash(text: str) -> int:
    """A document's content hash, 64 bits."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def held_out(text: str, val_fraction: float) -> bool:
    """Whether a document belongs to the validation split: its content's hash, as a fraction of 2**64."""
    return document_hash(text) < val_fraction * 2**64


def encode_unit(unit: Unit) -> Encoded:
    tok, cfg = _worker
    if unit.kind == "text":  # rows: its lines, against which undecodable bytes count like bad JSON lines
        text = unit.payload
        texts, bad, rows = [text], list(unit.bad), text.count("\n") + int(bool(text) and not text.endswith("\n"))
    elif unit.kind == "jsonl":
        texts, bad, rows = parse_json_lines(unit, cfg.text_field, cfg.names)
    else:
        texts = table_texts(unit, cfg.text_field, cfg.names)
        bad, rows = [], len(texts)
    pieces, owner = [], []
    for d, text in enumerate(texts):
        for piece in text_pieces(text):
            pieces.append(piece)
            owner.append(d)
    # encode_batch, not encode_batch_fast: measured 20% faster with tokenizers 0.23 (one thread, 3000 documents)
    encodings = tok.encode_batch(pieces, add_special_tokens=False) if pieces else []
    parts: list[list[np.ndarray]] = [[] for _ in texts]
    for d, enc in zip(owner, encodings):
        parts[d].append(np.array(enc.ids, dtype=cfg.dtype))
    bos = np.array([cfg.bos if cfg.bos is not None else 0], cfg.dtype)
    eos = np.array([cfg.eos], cfg.dtype)
    train, val, docs_val = [], [], 0
    whole_document = unit.kind != "text"
    for text, ids in zip(texts, parts):
        if whole_document and not text:
            continue  # an empty document adds nothing, not even a separator
        to_val = unit.split == "val" or (unit.split == "hash" and held_out(text, cfg.val_fraction))
        out = val if to_val else train
        docs_val += to_val and (whole_document or unit.last)
        if cfg.bos is not None and (whole_document or unit.first):
            out.append(bos)
        out.extend(ids)
        if whole_document or unit.last:
            out.append(eos)
    n_docs = sum(1 for t in texts if t) if whole_document else int(unit.last)
    empty = np.zeros(0, cfg.dtype)
    hashes = (np.array([document_hash(t) for t in texts if t], np.uint64) if whole_document and unit.split != "hash"
              else np.zeros(0, np.uint64))
    return Encoded(np.concatenate(train) if train else empty, np.concatenate(val) if val else empty,
                   n_docs - docs_val, docs_val, rows, bad, hashes)


class InProcessEncoder:
    """Encodes in this process (the tokenizers library's own threads do the batch in parallel)."""

    def __init__(self, config: EncoderConfig):
        init_encoder(config, in_pool=False)

    def map(self, units):
        for unit in units:
            yield replace(unit, payload=None), encode_unit(unit)

    def close(self):
        pass


class PoolEncoder:
    """Encodes in `num_proc` worker processes, results in order, with a bounded number of units in flight.

    Forked like torch's DataLoader workers (the children touch neither CUDA nor torch, only tokenizers in
    one thread each): spawn would re-run an unguarded `__main__` script in every child and start slower.
    A process pool executor, not multiprocessing.Pool: a worker killed (out of memory) fails the build
    instead of leaving it waiting forever for the lost unit."""

    def __init__(self, config: EncoderConfig, num_proc: int):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        self.pool = ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context(method),
                                        initializer=init_encoder, initargs=(config,))
        self.window = 2 * num_proc + 2

    def map(self, units):
        pending: deque = deque()
        for unit in units:
            pending.append((replace(unit, payload=None), self.pool.submit(encode_unit, unit)))
            if len(pending) >= self.window:
                yield self._next(pending)
        while pending:
            yield self._next(pending)

    @staticmethod
    def _next(pending: deque):
        from concurrent.futures.process import BrokenProcessPool
        meta, future = pending.popleft()
        try:
            return meta, future.result()
        except BrokenProcessPool:
            raise RuntimeError("a tokenizer process died while encoding the corpus (out of memory?); lower "
                               "data.num_proc or give the job more memory") from None

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


# ---- the writing side ---------------------------------------------------------------------------------------
class ShardWriter:
    """Appends encoded units to train.bin / val.bin; moves the last `val_fraction` of a text file's tokens to
    val.bin once the file is done (copied in bounded chunks). With `eos_at_split` (an EOS id) the training part
    left ends with that EOS, so it does not run on into the next file's first token."""

    COPY_TOKENS = 1 << 24

    def __init__(self, folder: Path, dtype, val_fraction: float, eos_at_split: int | None = None):
        self.folder, self.dtype, self.val_fraction = folder, np.dtype(dtype), val_fraction
        self.eos_at_split = eos_at_split
        self.train = open(folder / "train.bin", "wb")
        self.val = open(folder / "val.bin", "wb")
        self.n_train = self.n_val = 0
        self.docs_train = self.docs_val = 0
        self._tail_start = 0
        self._val_hashes: list[np.ndarray] = []
        self._val_sorted: np.ndarray | None = None   # the validation documents' distinct hashes, sorted
        self._val_counts: np.ndarray | None = None   # how many validation documents have each
        self._val_seen: np.ndarray | None = None     # which of them a training document repeats

    def add(self, unit: Unit, enc: Encoded) -> None:
        if unit.split == "val":
            self._val_hashes.append(enc.hashes)
        elif unit.split == "train" and len(enc.hashes):
            self._mark_in_val(enc.hashes)
        if unit.split == "tail" and unit.first:
            self._tail_start = self.n_train
        enc.train.tofile(self.train)
        enc.val.tofile(self.val)
        self.n_train += len(enc.train)
        self.n_val += len(enc.val)
        self.docs_train += enc.docs_train
        self.docs_val += enc.docs_val
        if unit.split == "tail" and unit.last:
            self._hold_out_tail()

    def _mark_in_val(self, hashes: np.ndarray) -> None:
        """Mark the validation documents (read first) that these training documents' hashes repeat."""
        if self._val_sorted is None:
            joined = np.concatenate(self._val_hashes) if self._val_hashes else np.zeros(0, np.uint64)
            self._val_sorted, self._val_counts = np.unique(joined, return_counts=True)
            self._val_seen = np.zeros(len(self._val_sorted), bool)
            self._val_hashes = []
        if not len(self._val_sorted):
            return
        at = np.minimum(np.searchsorted(self._val_sorted, hashes), len(self._val_sorted) - 1)
        self._val_seen[at[self._val_sorted[at] == hashes]] = True

    @property
    def val_documents_in_train(self) -> int:
        """Validation documents (each copy counted, as documents_val counts them) whose content the training
        documents repeat."""
        return 0 if self._val_seen is None else int(self._val_counts[self._val_seen].sum())

    def _hold_out_tail(self) -> None:
        n_val = int(round((self.n_train - self._tail_start) * self.val_fraction))
        cut = self.n_train - n_val
        self.train.flush()
        for start in range(cut, self.n_train, self.COPY_TOKENS):
            count = min(self.COPY_TOKENS, self.n_train - start)
            np.fromfile(self.folder / "train.bin", dtype=self.dtype, count=count,
                        offset=start * self.dtype.itemsize).tofile(self.val)
        self.train.seek(cut * self.dtype.itemsize)
        self.train.truncate()
        self.n_train, self.n_val = cut, self.n_val + n_val
        if n_val and self.eos_at_split is not None:  # the file's own EOS went with its tail
            np.array([self.eos_at_split], self.dtype).tofile(self.train)
            self.n_train += 1

    def close(self) -> None:
        self.train.close()
        self.val.close()


class DataProgress:
    """Reports tokenization progress to the sink as `data_progress` events (at most every `every_s`):
    documents, tokens, tokens/s, bytes read of the total and the ETA they give."""

    def __init__(self, sink, file_sizes: list[int], every_s: float = PROGRESS_EVERY_S):
        self.sink, self.sizes, self.every_s = sink, file_sizes, every_s
        self.total = max(sum(file_sizes), 1)
        self.file_done = [0.0] * len(file_sizes)   # bytes read of each file (files may come in any order)
        self.started = self.last = time.perf_counter()
        self.documents = self.tokens = 0
        self.done_bytes = 0.0

    def update(self, unit: Unit, enc: Encoded) -> None:
        self.documents += enc.docs_train + enc.docs_val
        self.tokens += len(enc.train) + len(enc.val)
        done = unit.position * self.sizes[unit.file]
        self.done_bytes += done - self.file_done[unit.file]
        self.file_done[unit.file] = done
        if time.perf_counter() - self.last >= self.every_s:
            self.report()

    def report(self, done: bool = False) -> dict:
        self.last = now = time.perf_counter()
        elapsed = max(now - self.started, 1e-9)
        fraction = 1.0 if done else min(self.done_bytes / self.total, 1.0)
        fields = dict(phase="tokenizing", documents=self.documents, tokens=self.tokens,
                      tokens_per_s=round(self.tokens / elapsed), bytes_done=int(fraction * self.total),
                      bytes_total=self.total, fraction=round(fraction, 4), elapsed_s=round(elapsed, 1),
                      eta_s=round(elapsed * (1 - fraction) / fraction, 1) if fraction > 0 else None, done=done)
        if self.sink is not None:
            self.sink.event("data_progress", **fields)
        return fields


class BadLines:
    """Lines that could not be read (invalid JSON, bytes that are not UTF-8): counted, the first few kept."""

    def __init__(self, max_fraction: float):
        self.max_fraction = max_fraction
        self.count = self.rows = 0
        self.examples: list[str] = []

    def add(self, enc: Encoded) -> None:
        self.rows += enc.rows
        self.count += len(enc.bad)
        self.examples.extend(enc.bad[:BAD_EXAMPLES - len(self.examples)])

    def check(self, final: bool = True) -> None:
        """Fails when too many lines were bad; before the end (`final=False`) only when far too many were, so
        a corpus that is not JSON lines at all fails in seconds, not after hours of reading."""
        limit = self.max_fraction * self.rows if final else 10 * self.max_fraction * self.rows + 1000
        if self.count and self.count > limit:
            raise CorpusError(f"{self.count:,} of {self.rows:,} lines of the corpus could not be read "
                              f"({self.count / self.rows:.3%}), more than data.max_bad_fraction "
                              f"({self.max_fraction:g}); first: {'; '.join(self.examples)}. Fix or drop those "
                              f"lines, or raise data.max_bad_fraction to skip them")


# ---- building and caching -----------------------------------------------------------------------------------
def splits_text_files(corpus: Corpus, *, has_val_corpus: bool) -> bool:
    """Whether a text file's tail is held out (the only split data.eos_at_split changes): not with a val_corpus,
    nor for a corpus of JSON lines/tables only."""
    return not has_val_corpus and any(file_format(p) == "text" for p in corpus.files)


@dataclass
class ShardRequest:
    """What a token cache is built from; `key()` names it."""
    corpus: Corpus
    tokenizer: object                    # a transformers fast tokenizer
    tokenizer_source: str                # "train" (the corpus's BPE), "checkpoint", or a path
    val_fraction: float
    val_corpus: Corpus | None = None
    num_proc: int | None = None          # None: every core
    max_bad_fraction: float = 0.001
    eos_at_split: bool = True            # data.eos_at_split: a text file's training part ends with EOS

    def splits_text_files(self) -> bool:
        return splits_text_files(self.corpus, has_val_corpus=self.val_corpus is not None)

    def legacy(self) -> bool:
        """A folder of text files with its own BPE and the held-out tail: the cache key (and bytes) of
        the lab's first format, so caches built before document formats existed stay valid."""
        return (self.tokenizer_source == "train" and self.val_corpus is None and self.corpus.text_only
                and self.corpus.folder is not None)

    def key(self) -> str:
        vocab = len(self.tokenizer)
        # Keys as they were without eos_at_split (its legacy value): caches built before it existed stay valid.
        cut = "-eos" if self.eos_at_split and self.splits_text_files() else ""
        if self.legacy():
            return (f"{self.corpus.content_hash()[:20]}-v{vocab}-val{self.val_fraction:g}"
                    f"-f{LEGACY_FORMAT_VERSION}{cut}")
        bos, eos = special_token_ids(self.tokenizer)
        settings = dict(corpus=self.corpus.content_hash(), text_field=self.corpus.text_field,
                        val_corpus=self.val_corpus.content_hash() if self.val_corpus else None,
                        val_fraction=None if self.val_corpus else self.val_fraction,
                        tokenizer=tokenizer_fingerprint(self.tokenizer), bos=bos, eos=eos, vocab=vocab)
        if cut:
            settings["eos_at_split"] = True
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
        return f"d{digest[:24]}-v{vocab}-f{SHARD_FORMAT_VERSION}"


def same_token_data(a: str, b: str) -> bool:
    """Whether two token caches (`ShardRequest.key`, a run's `data.cache`) hold the same tokens: their names
    without the format version ("-f<n>..."), which a new release may change for the same corpus and tokenizer."""
    return a.rsplit("-f", 1)[0] == b.rsplit("-f", 1)[0]


def build_token_shards(request: ShardRequest, cache_dir, sink=None) -> tuple[Path, dict, bool]:
    """(folder, meta, built here): the cached shards, built first when missing (under the lock)."""
    if sink is not None:  # the key hashes every byte of the corpus: seconds per GB
        sink.event("data_progress", phase="hashing the corpus", done=False)
    path = Path(cache_dir) / "shards" / request.key()
    if (path / "meta.json").exists():
        return path, json.loads((path / "meta.json").read_text()), False
    path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(path.parent / f".{path.name}.lock", sink):
        if (path / "meta.json").exists():  # another job built it while this one waited
            return path, json.loads((path / "meta.json").read_text()), False
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            meta = _build(request, tmp, sink)
            (tmp / "meta.json").write_text(json.dumps(meta))
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return path, meta, True


@contextmanager
def _exclusive(lock_path: Path, sink):
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if sink is not None:
                sink.event("data_progress", phase="waiting for another job building the same token cache",
                           done=False)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(request: ShardRequest, folder: Path, sink) -> dict:
    tok, corpus, val_corpus = request.tokenizer, request.corpus, request.val_corpus
    bos, eos = special_token_ids(tok)
    dtype = np.dtype(token_dtype(len(tok)))
    names = corpus.names + (val_corpus.names if val_corpus else [])
    config = EncoderConfig(tok.backend_tokenizer.to_str(), bos, eos, dtype.name, corpus.text_field,
                           request.val_fraction, names)
    num_proc = request.num_proc or default_num_proc()
    encoder = PoolEncoder(config, num_proc) if num_proc > 1 else InProcessEncoder(config)
    files = corpus.files + (val_corpus.files if val_corpus else [])
    progress = DataProgress(sink, [p.stat().st_size for p in files])
    bad = BadLines(request.max_bad_fraction)
    writer = ShardWriter(folder, dtype, request.val_fraction, eos if request.eos_at_split else None)
    units = corpus.units("train" if val_corpus else "hash")
    if val_corpus is not None:  # validation first: its documents are known when the training ones are counted
        units = itertools.chain(val_corpus.units("val", file_offset=len(corpus.files)), units)
    try:
        for unit, enc in encoder.map(units):
            writer.add(unit, enc)
            bad.add(enc)
            bad.check(final=False)
            progress.update(unit, enc)
    finally:
        encoder.close()
        writer.close()
    final = progress.report(done=True)
    bad.check()
    _check_not_empty(request, writer)
    return dict(dtype=dtype.name, train_tokens=writer.n_train, val_tokens=writer.n_val, vocab_size=len(tok),
                val_fraction=request.val_fraction, split=_split_rule(request), format_version=SHARD_FORMAT_VERSION,
                eos_at_split=request.eos_at_split and request.splits_text_files(),
                data=dict(files=len(files), file_names=[str(p) for p in files[:20]], bytes=final["bytes_total"],
                          documents_train=writer.docs_train, documents_val=writer.docs_val,
                          tokens_train=writer.n_train, tokens_val=writer.n_val, bad_lines=bad.count,
                          bad_examples=bad.examples, rows=bad.rows, bos=bos, eos=eos,
                          **_overlap(request, writer),
                          tokenize_s=final["elapsed_s"], tokens_per_s=final["tokens_per_s"], num_proc=num_proc))


def _overlap(request: ShardRequest, writer: ShardWriter) -> dict:
    """With data.val_corpus: its files that are training files (path or bytes), and - where both corpora hold
    documents of JSON lines or tables, compared by content hash - its documents the training documents repeat."""
    if request.val_corpus is None:
        return {}
    shared = shared_files(request.corpus, request.val_corpus)
    out = {"val_files_in_train": len(shared), "val_files_in_train_examples": shared[:3]}
    if not request.corpus.text_only and not request.val_corpus.text_only:
        out["val_documents_in_train"] = writer.val_documents_in_train
    return out


def _split_rule(request: ShardRequest) -> str:
    if request.val_corpus is not None:
        return "data.val_corpus"
    eos = " (the training part ends with EOS)" if request.eos_at_split and request.splits_text_files() else ""
    if request.corpus.text_only:
        return f"last val_fraction of each file's tokens{eos}"
    return f"documents whose content hash < val_fraction (text files: last val_fraction of their tokens{eos})"


def _check_not_empty(request: ShardRequest, writer: ShardWriter) -> None:
    where = ", ".join(request.corpus.names[:3]) + (" ..." if len(request.corpus.names) > 3 else "")
    if writer.docs_train + writer.docs_val == 0 or writer.n_train + writer.n_val == 0:
        raise CorpusError(f"the corpus ({where}) has no documents: its files are empty or every line was "
                          f"skipped; check data.corpus and data.text_field")
    if writer.n_val == 0 and request.corpus.text_only:  # split by tokens: the corpus is too short
        raise CorpusError(f"the corpus ({where}) has {writer.n_train} tokens, too few for data.val_fraction "
                          f"{request.val_fraction:g} of them to make a validation split; use a larger corpus, "
                          f"raise data.val_fraction or give data.val_corpus")
    if writer.n_val == 0:
        raise CorpusError(f"no document of the corpus ({writer.docs_train} documents) was held out for validation "
                          f"at data.val_fraction {request.val_fraction:g}; raise data.val_fraction or give "
                          f"data.val_corpus")
