"""Token shards, the fixed train/validation split, seeded batches, and a prefetching loader.

Shards (training.shards builds and caches them): documents packed with EOS (BOS where the tokenizer adds
one). The validation shard is `data.val_corpus`, else a fixed `val_fraction` held out, identical for every
recipe and seed: whole documents chosen by content hash for document formats, the **last `val_fraction` of
every file's tokens** for text files (splitting per file keeps every source represented in both).

Batches: the windows of a step are drawn by `numpy.random.Generator(PCG64([seed, step]))`, so the token
order depends only on (seed, step): every recipe sees the same tokens at the same step, and a resumed
run draws exactly what the uninterrupted run would have drawn. A step's global batch is drawn once;
data-parallel ranks and gradient-accumulation micro-steps take disjoint slices of it, so the tokens of a
step do not depend on the number of GPUs.

Validation: `val_batches * batch_size` non-overlapping windows of the validation shard, the same for every recipe
and seed. `data.val_windows = "spread"` (the default) takes them at evenly spaced places over the whole shard, so
every file's (or document range's) held-out part is represented in proportion to its length; "first" takes the
first ones in a row (the lab's definition before "spread": one or two books' tails of a multi-file corpus), kept for
runs stored with it.
"""
from __future__ import annotations

import queue
import threading
import time

import numpy as np
import torch

from training.corpus import CorpusError
from training.shards import ShardRequest, build_token_shards, token_dtype
from training.config import VAL_WINDOW_RULES
from training.tokenizer import as_corpus


def spread_slots(available: int, n: int) -> np.ndarray:
    """`n` of `available` equal slots (n <= available), one in the middle of each of n equal parts: slot
    floor((2i + 1) * available / 2n) - what data.val_windows "spread" takes, for windows and held-out text alike."""
    return (2 * np.arange(n, dtype=np.int64) + 1) * available // (2 * n)


class TokenDataset:
    """Train/val token streams as numpy memmaps (cached by corpus content, tokenizer and settings)."""

    def __init__(self, train: np.ndarray, val: np.ndarray, seq_len: int, vocab_size: int):
        if len(train) < seq_len + 2:
            raise CorpusError(f"the training split has {len(train)} tokens, fewer than one window of "
                             f"seq_len+1 = {seq_len + 1}; use a larger corpus or a smaller data.seq_len")
        self.train, self.val = train, val
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.info: dict = {}   # what the shards were built from (files, documents, tokens, bad lines)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_corpus(cls, corpus, tokenizer, *, seq_len: int, val_fraction: float, cache_dir,
                    tokenizer_source: str = "train", val_corpus=None, num_proc: int | None = None,
                    max_bad_fraction: float = 0.001, eos_at_split: bool = True, sink=None) -> "TokenDataset":
        """The shards of `corpus` (a Corpus, or a corpus folder/file/glob path) tokenized by `tokenizer`,
        built on first use (training.shards) and memory-mapped."""
        if not 0.0 < val_fraction <= 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5], got {val_fraction}")
        request = ShardRequest(as_corpus(corpus), tokenizer, tokenizer_source, val_fraction,
                               val_corpus=as_corpus(val_corpus) if val_corpus is not None else None,
                               num_proc=num_proc, max_bad_fraction=max_bad_fraction, eos_at_split=eos_at_split)
        path, meta, _ = build_token_shards(request, cache_dir, sink)
        dtype = np.dtype(meta["dtype"])
        train = np.memmap(path / "train.bin", dtype=dtype, mode="r", shape=(meta["train_tokens"],))
        val = np.memmap(path / "val.bin", dtype=dtype, mode="r", shape=(meta["val_tokens"],))
        ds = cls(train, val, seq_len, len(tokenizer))
        ds.info = {"tokens_train": meta["train_tokens"], "tokens_val": meta["val_tokens"], "split": meta["split"],
                   "cache": path.name, **meta.get("data", {})}
        return ds

    @classmethod
    def random(cls, vocab_size: int, seq_len: int, *, seed: int = 0, n_tokens: int = 1 << 22) -> "TokenDataset":
        """Uniform random tokens (throughput benchmarks only: nothing to learn)."""
        rng = np.random.Generator(np.random.PCG64(seed))
        dtype = token_dtype(vocab_size)
        train = rng.integers(0, vocab_size, size=n_tokens, dtype=np.int64).astype(dtype)
        val = rng.integers(0, vocab_size, size=max(n_tokens // 64, 4 * (seq_len + 1)), dtype=np.int64).astype(dtype)
        return cls(train, val, seq_len, vocab_size)

    # ---- sampling -----------------------------------------------------------------------------
    def batch(self, seed: int, step: int, batch_size: int) -> torch.Tensor:
        """The global batch of optimizer step `step`: (batch_size, seq_len + 1) int64 windows."""
        rng = np.random.Generator(np.random.PCG64([seed, step]))
        starts = rng.integers(0, len(self.train) - self.seq_len - 1, size=batch_size)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return torch.from_numpy(self.train[idx].astype(np.int64))

    def val_slots(self, n_windows: int, how: str = "spread") -> np.ndarray:
        """Which of the validation shard's non-overlapping windows (slot k: tokens [k*seq_len, (k+1)*seq_len])
        validation uses: `n_windows` of them (all there are when the shard holds fewer), "spread" evenly over the
        shard (slot floor((2i + 1) * available / 2n): the middle of each of n equal parts) or the "first" ones."""
        if how not in VAL_WINDOW_RULES:
            raise ValueError(f"val windows must be one of {list(VAL_WINDOW_RULES)}, got {how!r}")
        available = self.val_window_count
        n = max(min(n_windows, available), 0)
        if how == "first" or n == available:
            return np.arange(n, dtype=np.int64)
        return spread_slots(available, n)

    @property
    def val_window_count(self) -> int:
        """How many non-overlapping windows of seq_len + 1 tokens the validation shard holds."""
        return max((len(self.val) - 1) // self.seq_len, 0)

    def val_windows(self, n_windows: int, how: str = "spread") -> torch.Tensor:
        """The validation windows `val_slots` names, [n, seq_len + 1] token ids (fewer if the shard is short)."""
        slots = self.val_slots(n_windows, how)
        if len(slots) == 0:
            return torch.empty(0, self.seq_len + 1, dtype=torch.int64)
        idx = slots[:, None] * self.seq_len + np.arange(self.seq_len + 1)[None, :]
        return torch.from_numpy(self.val[idx].astype(np.int64))


def split_batch(global_batch: torch.Tensor, *, rank: int, world: int, grad_accum: int) -> list[torch.Tensor]:
    """This rank's micro-batches of a step: rank r takes rows [r*B/world, (r+1)*B/world), cut into
    `grad_accum` equal micro-batches."""
    per_rank = global_batch.shape[0] // world
    mine = global_batch[rank * per_rank:(rank + 1) * per_rank]
    return list(mine.chunk(grad_accum))


class BatchLoader:
    """Yields (step, [micro-batches on device]) for steps start..end.

    On CUDA with `prefetch`, a background thread gathers the windows, pins them and issues the
    host→device copy on a side stream, `depth` steps ahead, so the train step never waits on numpy.
    `wait_s` accumulates the time the consumer blocked on the loader (the data-wait metric).
    """

    def __init__(self, dataset: TokenDataset, *, seed: int, batch_size: int, start_step: int, end_step: int,
                 rank: int, world: int, grad_accum: int, device: torch.device, prefetch: bool = True,
                 depth: int = 3):
        self.ds, self.seed, self.batch_size = dataset, seed, batch_size
        self.start, self.end = start_step, end_step
        self.rank, self.world, self.grad_accum = rank, world, grad_accum
        self.device = device
        self.threaded = prefetch and device.type == "cuda"
        self.wait_s = 0.0
        self._q: queue.Queue | None = None
        self._stop = threading.Event()
        if self.threaded:
            self._q = queue.Queue(maxsize=depth)
            self._stream = torch.cuda.Stream(device=device)
            self._thread = threading.Thread(target=self._produce, daemon=True, name="plab-prefetch")
            self._thread.start()

    def _load(self, step: int):
        micro = split_batch(self.ds.batch(self.seed, step, self.batch_size), rank=self.rank, world=self.world,
                            grad_accum=self.grad_accum)
        if self.device.type != "cuda":
            return [m.to(self.device) for m in micro], None
        with torch.cuda.stream(self._stream) if self.threaded else _nullcontext():
            out = [m.pin_memory().to(self.device, non_blocking=True) for m in micro]
            event = torch.cuda.Event()
            event.record()
        return out, event

    def _produce(self):
        try:
            for step in range(self.start, self.end + 1):
                item = (step, *self._load(step))
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # surface loader errors in the training thread
            self._q.put(exc)

    def __iter__(self):
        for step in range(self.start, self.end + 1):
            t0 = time.perf_counter()
            if self.threaded:
                item = self._q.get()
                if isinstance(item, BaseException):
                    raise item
                got_step, micro, event = item
                assert got_step == step
                # Make the compute stream wait for the copy without blocking the host.
                torch.cuda.current_stream(self.device).wait_event(event)
                for m in micro:
                    m.record_stream(torch.cuda.current_stream(self.device))
            else:
                micro, _ = self._load(step)
            self.wait_s += time.perf_counter() - t0
            yield step, micro

    def close(self):
        self._stop.set()


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
