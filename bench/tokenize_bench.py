"""Tokenization throughput and memory of the data pipeline (training.shards) against the tokenizer's own
`encode_batch` on the same cores and the same documents.

Builds a JSONL corpus of `--size-gb` from the shipped corpora (british_fiction, english_novels_100,
tinyshakespeare: cut into documents of 5-60 lines, shuffled, repeated in a new order per pass) in a temporary
folder (never in the repository), trains a byte-level BPE (`--vocab-size`) on the documents, then measures in
separate processes, one after the other:
  * the upper bound: `encode_batch` over the documents in batches of 1000, parsing not timed, on
    `--num-proc` threads (RAYON_RS_NUM_CPUS); timed before and after ours, the faster run counts (the load of a
    shared machine moves between runs);
  * ours: `build_token_shards` with `--num-proc` worker processes (the default strategy): the tokenizing
    phase (reading, JSON parsing, tokenizing, packing, writing) and end to end (with the content hash);
  * ours in one process (`num_proc=1`: the tokenizers library's own threads, RAYON_RS_NUM_CPUS = num_proc),
    to compare the two ways of using every core;
these three on the corpus's first `--reference-gb` (default: all of it; the documents are shuffled, so a prefix
is a sample of the same data), then ours again on the whole corpus (its peak RSS is the one the goal is about).
Peak RSS: the largest sum over the process and its children, sampled every 0.2 s.
Goals (issue "Your model and your data"): ours >= 0.8x the upper bound, peak RSS < 1.5 GB.
Writes `bench/results/tokenize_bench_<date>_<host>.json` (device, date, commit).

    python bench/tokenize_bench.py [--size-gb 2] [--num-proc N] [--vocab-size 32000] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchmeta import git_commit  # noqa: E402

SHIPPED = ("british_fiction", "english_novels_100", "tinyshakespeare")


def shipped_documents(data_dir: Path, seed: int = 0) -> list[str]:
    """The shipped corpora's text files cut into documents of 5-60 lines."""
    rng = random.Random(seed)
    docs = []
    for name in SHIPPED:
        for path in sorted((data_dir / name).iterdir()):
            if not path.name.endswith((".txt", ".txt.gz")):
                continue
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8", errors="replace") as f:
                lines = f.read().replace("\r\n", "\n").split("\n")
            i = 0
            while i < len(lines):
                k = rng.randint(5, 60)
                doc = "\n".join(lines[i:i + k]).strip()
                if doc:
                    docs.append(doc + "\n")
                i += k
    return docs


def write_corpus(path: Path, docs: list[str], size_bytes: int, seed: int = 0) -> int:
    """JSON lines of `docs`, shuffled anew each pass, until `size_bytes`; returns the documents written."""
    rng = random.Random(seed)
    written = n = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size_bytes:
            order = list(range(len(docs)))
            rng.shuffle(order)
            for i in order:
                written += f.write(json.dumps({"id": n, "text": docs[i]}) + "\n")
                n += 1
                if written >= size_bytes:
                    break
    return n


def child_ours(args) -> dict:
    from training.corpus import Corpus
    from training.shards import ShardRequest, build_token_shards
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    t0 = time.perf_counter()
    request = ShardRequest(Corpus([Path(args.corpus)]), tok, "train", 0.01, num_proc=args.num_proc)
    _, meta, built = build_token_shards(request, args.cache)
    wall = time.perf_counter() - t0
    d = meta["data"]
    tokens = d["tokens_train"] + d["tokens_val"]
    return {"built": built, "tokens": tokens, "documents": d["documents_train"] + d["documents_val"],
            "wall_s": round(wall, 2), "tokenize_s": d["tokenize_s"], "tokens_per_s_end_to_end": round(tokens / wall),
            "tokens_per_s": d["tokens_per_s"], "num_proc": d["num_proc"]}


def child_upper(args) -> dict:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(args.tokenizer).backend_tokenizer
    tokens = docs = 0
    timed = 0.0
    with open(args.corpus, encoding="utf-8") as f:
        while True:
            batch = [json.loads(line)["text"] for _, line in zip(range(1000), f)]
            if not batch:
                break
            t0 = time.perf_counter()
            encodings = tok.encode_batch(batch, add_special_tokens=False)
            tokens += sum(len(e.ids) for e in encodings)
            timed += time.perf_counter() - t0
            docs += len(batch)
    return {"tokens": tokens + docs, "documents": docs, "timed_s": round(timed, 2),
            "tokens_per_s": round((tokens + docs) / timed)}  # + one EOS per document, as ours packs


def measure(mode: str, args, num_proc: int, cache: Path | None = None) -> dict:
    """Runs a child in a fresh process; returns its answer with the peak RSS of its process tree."""
    import psutil

    env = dict(os.environ, PYTHONPATH=str(REPO), RAYON_RS_NUM_CPUS=str(args.num_proc))
    cmd = [sys.executable, __file__, "--child", mode, "--corpus", str(args.corpus), "--tokenizer", str(args.tokenizer),
           "--num-proc", str(num_proc), "--cache", str(cache or args.workdir / "unused")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    peak = [0]

    def sample():
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                procs = [root, *root.children(recursive=True)]
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            time.sleep(0.2)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed with exit code {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_gib"] = round(peak[0] / 2**30, 3)
    print(f"[tokenize_bench] {mode}: {result}", flush=True)
    return result


def prepare(args) -> dict:
    from training.tokenizer import get_tokenizer, tokenizer_cache_path

    docs = shipped_documents(Path(args.data_dir))
    t0 = time.perf_counter()
    n_docs = write_corpus(args.corpus, docs, int(args.size_gb * 2**30))
    write_s = time.perf_counter() - t0
    source = args.workdir / "bpe_source"
    source.mkdir(exist_ok=True)
    (source / "sample.txt").write_text("".join(docs[:20_000]))  # the BPE trains on 16 MB of it anyway
    get_tokenizer(source, args.vocab_size, args.workdir / "tok")
    args.tokenizer = tokenizer_cache_path(source, args.vocab_size, args.workdir / "tok")
    print(f"[tokenize_bench] corpus: {n_docs:,} documents, {args.corpus.stat().st_size / 2**30:.2f} GiB "
          f"written in {write_s:.0f} s", flush=True)
    return {"documents": n_docs, "bytes": args.corpus.stat().st_size, "distinct_documents": len(docs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--num-proc", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--workdir", type=Path, default=None, help="where the corpus is written (default: a temp dir)")
    ap.add_argument("--reference-gb", type=float, default=None,
                    help="compare with the upper bound on this prefix of the corpus (default: the whole corpus)")
    ap.add_argument("--skip-one-process", action="store_true", help="skip the one-process (library threads) run")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", choices=("ours", "upper"), help=argparse.SUPPRESS)
    ap.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps((child_ours if args.child == "ours" else child_upper)(args)), flush=True)
        return
    if args.size_gb <= 0 or args.num_proc < 1:
        raise SystemExit("--size-gb must be > 0 and --num-proc >= 1")
    own_workdir = args.workdir is None
    args.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="plab-tokenize-bench-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.corpus = args.workdir / "corpus.jsonl"
    out = args.out or REPO / "bench" / "results" / (
        f"tokenize_bench_{dt.datetime.now(dt.timezone.utc):%Y-%m-%dT%H%M}_{args.num_proc}proc.json")
    try:
        corpus = prepare(args)
        full = args.corpus
        if args.reference_gb is not None and args.reference_gb < args.size_gb:
            args.corpus = prefix_of(full, int(args.reference_gb * 2**30))
        before = measure("upper", args, args.num_proc)
        ours = measure("ours", args, args.num_proc, args.workdir / "cache_ref")
        one = None if args.skip_one_process or args.num_proc == 1 else measure("ours", args, 1,
                                                                             args.workdir / "cache_one")
        # Again after ours: on a shared machine the load moves between runs; the faster of the two is the bound.
        after = measure("upper", args, args.num_proc)
        upper = max(before, after, key=lambda r: r["tokens_per_s"])
        upper["runs_tokens_per_s"] = [before["tokens_per_s"], after["tokens_per_s"]]
        result = report(args, corpus, upper, ours, one, out)
        if args.corpus != full:
            args.corpus = full
            result["ours_whole_corpus"] = whole = measure("ours", args, args.num_proc, args.workdir / "cache_full")
            result["goals"]["peak_rss < 1.5 GiB"] = whole["peak_rss_gib"] < 1.5
            result["ratio_whole_corpus_vs_reference_upper_bound"] = round(
                whole["tokens_per_s"] / upper["tokens_per_s"], 3)
            write(result, out)
    finally:
        if own_workdir:
            shutil.rmtree(args.workdir, ignore_errors=True)
    print(json.dumps(result, indent=2))


def prefix_of(path: Path, size_bytes: int) -> Path:
    """The first whole lines of `path` up to `size_bytes`."""
    out = path.with_name("reference.jsonl")
    with open(path, "rb") as src, open(out, "wb") as dst:
        written = 0
        for line in src:
            if written >= size_bytes:
                break
            written += dst.write(line)
    return out


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(out.read_text())


def report(args, corpus: dict, upper: dict, ours: dict, one: dict | None, out: Path) -> dict:
    """The result of the reference comparison, written at once (the whole-corpus run is added after)."""
    ratio = ours["tokens_per_s"] / upper["tokens_per_s"]
    result = {
        "bench": "tokenize_bench", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "host": socket.gethostname(), "device": f"cpu ({platform.processor() or 'x86_64'})",
        "cpu_cores": len(os.sched_getaffinity(0)), "num_proc": args.num_proc, "vocab_size": args.vocab_size,
        "corpus": {**corpus, "size_gb": args.size_gb, "format": "jsonl", "sources": list(SHIPPED),
                   "reference_gb": args.reference_gb or args.size_gb},
        "upper_bound_encode_batch": upper, "ours_processes": ours, "ours_one_process_library_threads": one,
        "ratio_tokenize_phase": round(ratio, 3),
        "ratio_end_to_end": round(ours["tokens_per_s_end_to_end"] / upper["tokens_per_s"], 3),
        "tokens_match_upper_bound": ours["tokens"] == upper["tokens"],
        "goals": {"ratio >= 0.8": ratio >= 0.8, "peak_rss < 1.5 GiB": ours["peak_rss_gib"] < 1.5},
    }
    write(result, out)
    return result


if __name__ == "__main__":
    main()
