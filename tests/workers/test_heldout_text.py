"""The held-out text the worker scores plab_heldout_bpb on: the run's validation split, decoded - spread over it as
the val loss's windows are (data.val_windows), so a folder of books is not judged on its first books' tails."""
from __future__ import annotations

import pytest

from training.evaluation import heldout
from workers.jobs import evaluate


def test_slices_are_the_whole_split_the_first_tokens_or_chunks_in_the_middle_of_equal_parts():
    size = heldout.HELDOUT_CHUNK_TOKENS
    assert heldout.heldout_slices(1000, 400_000, "spread") == [slice(0, 1000)]
    assert heldout.heldout_slices(10**6, 400_000, "first") == [slice(0, 400_000)]
    spread = heldout.heldout_slices(10**6, 400_000, "spread")
    n, available = 400_000 // size, 10**6 // size
    assert len(spread) == n and all(s.stop - s.start == size for s in spread)
    assert [s.start for s in spread] == [(2 * i + 1) * available // (2 * n) * size for i in range(n)]
    assert all(a.stop <= b.start for a, b in zip(spread, spread[1:])) and spread[-1].stop <= 10**6
    assert spread[0].start > 0 and spread[-1].stop > 10**6 - 2 * 10**6 // n  # both ends of the split


def test_a_folder_of_books_is_scored_on_every_books_held_out_tail(tmp_path, monkeypatch):
    names = ["alpha", "bravo", "charlie", "delta"]
    books = tmp_path / "books"
    books.mkdir()
    for name in names:
        (books / f"{name}.txt").write_text("".join(f"{name} says line {i} of the {name} book.\n" for i in range(1500)))
    monkeypatch.setattr(heldout, "HELDOUT_CHUNK_TOKENS", 64)

    def text(rule):
        spec = {"model": "tiny", "data": {"corpus": str(books), "vocab_size": 400, "seq_len": 32, "val_fraction": 0.1,
                                          "val_windows": rule}}
        out = evaluate.validation_file(tmp_path / "home", 7, spec)
        assert evaluate.validation_text(spec, out, max_tokens=512) == str(out)
        return out, out.read_text()

    first_file, first = text("first")
    spread_file, spread = text("spread")
    assert first_file.name == "validation.txt" and spread_file.name == "validation_spread.txt"
    assert [n for n in names if n in first] == ["alpha"]
    assert [n for n in names if n in spread] == names
    # eight pieces of 64 tokens, decoded, a blank line between them and between the documents they hold; the
    # separators' own text is not in it. "first" is the text as it always was: the first tokens, decoded whole.
    assert 512 // 64 - 1 <= spread.count("\n\n") <= 512 // 64 - 1 + 3 and "<|endoftext|>" not in spread

    from training.config import RunSpec
    from training.setup import open_token_dataset

    tok, ds = open_token_dataset(RunSpec.from_dict({"model": "tiny", "data": {
        "corpus": str(books), "vocab_size": 400, "seq_len": 32, "val_fraction": 0.1}}), _home_cache())
    assert first == tok.decode(ds.val[:512].tolist())


def _home_cache():
    from training.config import plab_home

    return plab_home() / "cache"


@pytest.mark.parametrize("spec", [{"external": True, "recipe": "bf16"}])
def test_a_spec_that_is_not_ours_has_no_held_out_file_rule(spec, tmp_path):
    from training.config import SpecError

    with pytest.raises(SpecError):
        evaluate.validation_file(tmp_path, 1, spec)
