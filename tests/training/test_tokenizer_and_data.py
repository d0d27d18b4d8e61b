"""Tokenizer cache, token shards, the fixed split, and seed-determined batches."""
import numpy as np
import pytest
import torch

from training import tokenizer as tokenizer_module
from training.config import data_root
from training.data import TokenDataset, split_batch
from training.corpus import list_corpus_files
from training.tokenizer import EOS_TOKEN, get_tokenizer, tokenizer_cache_path

CORPUS = data_root() / "tinyshakespeare"


@pytest.fixture(scope="module")
def tok(cache_dir):
    return get_tokenizer(CORPUS, 512, cache_dir)


@pytest.fixture(scope="module")
def dataset(tok, cache_dir):
    return TokenDataset.from_corpus(CORPUS, tok, seq_len=32, val_fraction=0.05, cache_dir=cache_dir)


def test_corpus_files_are_sorted_text_files_only():
    assert [p.name for p in list_corpus_files(CORPUS)] == ["input.txt"]  # SOURCE.md is provenance, not text


def test_tokenizer_is_byte_level_bpe_with_bos_eos_and_round_trips(tok):
    assert len(tok) == 512 and tok.bos_token == tok.eos_token == EOS_TOKEN
    text = "ROMEO:\nWhat, ho! — ünïcode survives\n"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_second_request_is_served_from_the_cache_without_retraining(tok, cache_dir, monkeypatch):
    assert (tokenizer_cache_path(CORPUS, 512, cache_dir) / "tokenizer.json").exists()

    def refuse(*a, **k):
        raise AssertionError("the BPE was retrained although it is cached")
    monkeypatch.setattr(tokenizer_module, "_train_bpe", refuse)
    again = get_tokenizer(CORPUS, 512, cache_dir)
    assert again.get_vocab() == tok.get_vocab()


def test_cache_key_includes_the_vocab_size(cache_dir):
    assert tokenizer_cache_path(CORPUS, 512, cache_dir) != tokenizer_cache_path(CORPUS, 1024, cache_dir)


def test_shards_are_uint16_with_the_last_fraction_of_each_file_held_out(dataset, tok):
    assert dataset.train.dtype == np.uint16 and dataset.val.dtype == np.uint16
    n = len(dataset.train) - 1 + len(dataset.val)  # the file's tokens, and an EOS that ends its training part
    assert len(dataset.val) == round(n * 0.05)
    text = (CORPUS / "input.txt").read_text()
    tail = tok.decode(dataset.val[:-1].tolist())  # last token is the file's EOS
    assert text.endswith(tail) and len(tail) > 1000
    assert dataset.val[-1] == tok.eos_token_id and dataset.train[-1] == tok.eos_token_id
    assert text.startswith(tok.decode(dataset.train[:-1].tolist()) + tail)


def _books(folder, names, lines=400):
    for name in names:
        (folder / f"{name}.txt").write_text("".join(f"{name} says line {i} of the {name} book.\n"
                                                    for i in range(lines)))


def test_a_text_files_training_part_ends_with_eos_where_its_tail_is_cut_off(tmp_path, cache_dir):
    """data.eos_at_split: two books' training parts are two documents (EOS between them), as every document of
    the corpus is; without it (specs stored before the key) the first book's training part runs on into the
    second's first token, in the cache it always had."""
    _books(tmp_path, ["alpha", "bravo"])
    tok = get_tokenizer(tmp_path, 400, cache_dir)
    eos = tok.eos_token_id
    new = TokenDataset.from_corpus(tmp_path, tok, seq_len=16, val_fraction=0.1, cache_dir=cache_dir)
    old = TokenDataset.from_corpus(tmp_path, tok, seq_len=16, val_fraction=0.1, cache_dir=cache_dir,
                                   eos_at_split=False)
    assert new.info["cache"] != old.info["cache"] and old.info["cache"].endswith("-f1")  # the legacy key, unchanged
    assert np.array_equal(new.val, old.val)  # the held-out tails do not change
    assert list(np.flatnonzero(old.train == eos)) == []
    at = np.flatnonzero(new.train == eos)
    assert len(at) == 2 and at[1] == len(new.train) - 1 and len(new.train) == len(old.train) + 2
    first, second = tok.decode(new.train[:at[0]].tolist()), tok.decode(new.train[at[0] + 1:-1].tolist())
    assert first.startswith("alpha") and "bravo" not in first and second.startswith("bravo") and "alpha" not in second
    assert np.array_equal(np.delete(new.train, at), old.train)
    assert tok.decode(old.train.tolist()) == first + second  # no separator: alpha's part ran on into bravo


def test_eos_at_split_changes_no_cache_without_a_text_files_tail(tmp_path, cache_dir):
    """Documents of JSON lines are held out whole (each already ends with EOS), and so are the text files of a
    corpus with data.val_corpus: the option changes nothing there, so the caches stay shared."""
    import json as _json
    from training.corpus import Corpus
    from training.shards import ShardRequest
    (tmp_path / "docs.jsonl").write_text("".join(_json.dumps({"text": f"document {i} here"}) + "\n"
                                                 for i in range(300)))
    _books(tmp_path, ["alpha", "bravo"], lines=50)
    tok = get_tokenizer(CORPUS, 512, cache_dir)
    docs = Corpus([tmp_path / "docs.jsonl"])
    text, val = Corpus([tmp_path / "alpha.txt"]), Corpus([tmp_path / "bravo.txt"])
    for corpus, val_corpus in ((docs, None), (text, val)):
        keys = {ShardRequest(corpus, tok, "train", 0.1, val_corpus=val_corpus, eos_at_split=flag).key()
                for flag in (True, False)}
        assert len(keys) == 1
    assert len({ShardRequest(text, tok, "train", 0.1, eos_at_split=flag).key() for flag in (True, False)}) == 2


def test_batches_depend_only_on_seed_and_step(dataset):
    a = dataset.batch(seed=7, step=3, batch_size=4)
    assert a.shape == (4, 33) and a.dtype == torch.int64
    assert torch.equal(a, dataset.batch(seed=7, step=3, batch_size=4))
    assert not torch.equal(a, dataset.batch(seed=7, step=4, batch_size=4))
    assert not torch.equal(a, dataset.batch(seed=8, step=3, batch_size=4))


def test_ranks_and_micro_batches_partition_the_global_batch(dataset):
    glob = dataset.batch(seed=0, step=1, batch_size=8)
    parts = [m for r in range(2) for m in split_batch(glob, rank=r, world=2, grad_accum=2)]
    assert [len(p) for p in parts] == [2, 2, 2, 2]
    assert torch.equal(torch.cat(parts), glob)


def test_validation_windows_are_fixed_and_disjoint_from_training(dataset):
    v = dataset.val_windows(6)
    assert torch.equal(v, dataset.val_windows(6)) and v.shape == (6, 33)
    first = dataset.val_windows(6, "first")
    assert torch.equal(first[1, :1], first[0, -1:])  # consecutive windows share one boundary token only


def test_validation_windows_spread_over_the_split_and_first_keeps_the_old_windows(dataset):
    available = (len(dataset.val) - 1) // 32
    assert available > 12
    spread = dataset.val_slots(6)
    assert list(spread) == [(2 * k + 1) * available // 12 for k in range(6)]  # the middle of each sixth
    assert spread[0] >= available // 12 - 1 and spread[-1] >= available * 11 // 12 - 1
    assert list(dataset.val_slots(6, "first")) == list(range(6))
    # as many as there are, or more: every window, in order, either way
    assert list(dataset.val_slots(available)) == list(dataset.val_slots(available + 5, "first")) == list(range(available))
    windows = dataset.val_windows(6)
    for row, slot in zip(windows, spread):
        assert torch.equal(row, torch.from_numpy(dataset.val[slot * 32: slot * 32 + 33].astype(np.int64)))
    with pytest.raises(ValueError, match="one of"):
        dataset.val_slots(6, "random")


def test_spread_windows_take_every_files_held_out_tail_first_ones_only_the_first_file(tmp_path, cache_dir):
    """The held-out split of a folder of books is their tails one after another: the first windows in a row are
    the first book's; spread windows come from every book, in proportion to its tail."""
    names = ["alpha", "bravo", "charlie", "delta"]
    for name in names:
        (tmp_path / f"{name}.txt").write_text("".join(f"{name} says line {i} of the {name} book.\n"
                                                      for i in range(1500)))
    tok = get_tokenizer(tmp_path, 400, cache_dir)
    ds = TokenDataset.from_corpus(tmp_path, tok, seq_len=16, val_fraction=0.1, cache_dir=cache_dir)

    def books(how: str) -> list[set[str]]:
        return [{n for n in names if n in tok.decode(w.tolist())} for w in ds.val_windows(8, how)]

    assert set.union(*books("first")) == {"alpha"}
    spread = books("spread")
    # each book's tail is in one to three of the eight (about two each; a window may straddle two tails), in order
    assert all(1 <= sum(n in b for b in spread) <= 3 for n in names), [sorted(b) for b in spread]
    assert [min(i for i, b in enumerate(spread) if n in b) for n in names] == sorted(
        min(i for i, b in enumerate(spread) if n in b) for n in names), spread


def test_random_corpus_uses_uint32_beyond_65535_tokens():
    ds = TokenDataset.random(70_000, 16, n_tokens=4096)
    assert ds.train.dtype == np.uint32 and int(ds.train.max()) < 70_000


def test_encoding_in_pieces_gives_exactly_the_tokens_of_the_whole_text(tok):
    from training.corpus import text_pieces
    shakespeare = (CORPUS / "input.txt").read_text()[:60_000]
    whitespace_heavy = "".join(f"line {i}\n\n\n  indented {i}  \n \n" for i in range(2000))
    for text in (shakespeare, whitespace_heavy):
        whole = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        for chunk_chars in (97, 1000):
            pieces = text_pieces(text, chunk_chars=chunk_chars)
            assert "".join(pieces) == text and len(pieces) > 1
            got = [i for enc in tok.backend_tokenizer.encode_batch(pieces, add_special_tokens=False) for i in enc.ids]
            assert got == whole
