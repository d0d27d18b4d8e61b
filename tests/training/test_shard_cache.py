"""The token cache under concurrency and at scale: two jobs building the same shards (one builds, the other
waits, nobody sees a partial cache), memory that does not grow with the corpus, and batches that depend only
on (seed, step) - the same for every recipe and across a resume."""
import fcntl
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from training.config import data_root
from training.corpus import Corpus
from training.shards import ShardRequest
from training.tokenizer import get_tokenizer, tokenizer_cache_path

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE = data_root() / "tinyshakespeare"

BUILD = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from training.corpus import Corpus
    from training.shards import ShardRequest, build_token_shards
    from training.sink import MetricSink
    from transformers import PreTrainedTokenizerFast

    class Say(MetricSink):
        def event(self, kind, **fields):
            print(json.dumps({"kind": kind, **fields}), flush=True)

    if __name__ == "__main__":
        tok = PreTrainedTokenizerFast.from_pretrained(sys.argv[1])
        request = ShardRequest(Corpus([Path(sys.argv[2])]), tok, "train", 0.1, num_proc=int(sys.argv[4]))
        path, meta, built = build_token_shards(request, sys.argv[3], Say())
        rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
        print(json.dumps({"kind": "end", "built": built, "meta": meta, "path": str(path), "rss_kib": rss}), flush=True)
""")


@pytest.fixture(scope="module")
def tok_dir(cache_dir):
    get_tokenizer(SHAKESPEARE, 512, cache_dir)
    return tokenizer_cache_path(SHAKESPEARE, 512, cache_dir)


def write_jsonl(path: Path, n_bytes: int) -> Path:
    """Documents of 5-60 lines of tinyshakespeare, repeated to `n_bytes` of JSON lines."""
    lines = (SHAKESPEARE / "input.txt").read_text().split("\n")
    docs, i, k = [], 0, 5
    while i < len(lines):
        docs.append("\n".join(lines[i:i + k]) + "\n")
        i, k = i + k, 5 + (k * 7) % 56
    with open(path, "w") as f:
        written = j = 0
        while written < n_bytes:
            written += f.write(json.dumps({"text": docs[j % len(docs)]}) + "\n")
            j += 1
    return path


def start_build(tok_dir, corpus, cache, num_proc=1):
    return subprocess.Popen([sys.executable, "-c", BUILD, str(tok_dir), str(corpus), str(cache), str(num_proc)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO),
                                                                              "PATH": "/usr/bin:/bin"})


def test_two_jobs_building_the_same_cache_one_builds_the_other_waits(tmp_path, tok_dir):
    from transformers import PreTrainedTokenizerFast

    corpus = write_jsonl(tmp_path / "c.jsonl", 300_000)
    cache = tmp_path / "cache"
    key = ShardRequest(Corpus([corpus]), PreTrainedTokenizerFast.from_pretrained(str(tok_dir)), "train", 0.1).key()
    (cache / "shards").mkdir(parents=True)
    # Hold the build lock as a third job would, so both start while a build is under way.
    with open(cache / "shards" / f".{key}.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        jobs = [start_build(tok_dir, corpus, cache) for _ in range(2)]
        for job in jobs:
            phases = [json.loads(job.stdout.readline())["phase"] for _ in range(2)]
            assert phases == ["hashing the corpus", "waiting for another job building the same token cache"]
        assert not (cache / "shards" / key).exists()
        fcntl.flock(held, fcntl.LOCK_UN)
    ends = []
    for job in jobs:
        out, _ = job.communicate(timeout=120)
        assert job.returncode == 0
        ends.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(e["built"] for e in ends) == [False, True]
    assert ends[0]["meta"] == ends[1]["meta"] and ends[0]["path"] == ends[1]["path"] == str(cache / "shards" / key)
    leftovers = [p.name for p in (cache / "shards").iterdir() if p.name not in (key, f".{key}.lock")]
    assert leftovers == []  # the builder's temporary folder was renamed into place, nothing half-written


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_corpus(tmp_path, tok_dir):
    rss = {}
    for name, size in (("small", 2_000_000), ("large", 20_000_000)):
        job = start_build(tok_dir, write_jsonl(tmp_path / f"{name}.jsonl", size), tmp_path / name, num_proc=2)
        out, _ = job.communicate(timeout=600)
        assert job.returncode == 0
        rss[name] = json.loads(out.strip().splitlines()[-1])["rss_kib"]
    # Reading the corpus (or its tokens) whole would add ~18 MB of text and ~20 MB of token lists.
    assert rss["large"] - rss["small"] < 12 * 1024, rss


def _spy_batches(monkeypatch):
    from training.data import TokenDataset

    seen = {}
    original = TokenDataset.batch

    def batch(self, seed, step, batch_size):
        out = original(self, seed, step, batch_size)
        seen[step] = out.clone()
        return out
    monkeypatch.setattr(TokenDataset, "batch", batch)
    return seen


def test_first_batches_are_identical_for_every_recipe_and_across_a_resume(make_spec, cache_dir, tmp_path,
                                                                           monkeypatch):
    from training.sink import ListSink
    from training.train import train

    runs = {}
    for recipe in ("bf16", "fp8_tensorwise", "nvfp4"):
        runs[recipe] = _spy_batches(monkeypatch)
        train(make_spec(recipe=recipe, training={"steps": 3}), ListSink(), cache_dir=cache_dir)
    for recipe, batches in runs.items():
        assert sorted(batches) == [1, 2, 3]
        assert all(torch.equal(batches[s], runs["bf16"][s]) for s in batches), recipe
    spec = make_spec(training={"steps": 3, "checkpoint_every": 2})
    first = _spy_batches(monkeypatch)
    asked = iter([False, False, True])  # stop before step 3: the run ends with its step-2 checkpoint
    assert train(spec, ListSink(), output_dir=tmp_path, cache_dir=cache_dir,
                 should_stop=lambda: next(asked)).status == "cancelled"
    resumed = _spy_batches(monkeypatch)
    train(spec, ListSink(), output_dir=tmp_path, cache_dir=cache_dir)
    assert sorted(first) == [1, 2, 3] and sorted(resumed) == [3]
    assert torch.equal(resumed[3], runs["bf16"][3])
