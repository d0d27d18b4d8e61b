"""Corpora in every format give the same tokens; bad input is counted or named; shards are packed with EOS
(BOS where the tokenizer adds one) and do not depend on the number of tokenizer processes."""
import gzip
import json
import os

import numpy as np
import pytest

from training.config import data_root
from training.corpus import Corpus, CorpusError, list_corpus_files
from training.shards import ShardRequest, build_token_shards, held_out
from training.sink import ListSink
from training.tokenizer import get_tokenizer

SHAKESPEARE = data_root() / "tinyshakespeare"


@pytest.fixture(scope="module")
def tok(cache_dir):
    return get_tokenizer(SHAKESPEARE, 512, cache_dir)


@pytest.fixture(scope="module")
def docs():
    """Speeches of tinyshakespeare as documents (with non-ASCII text and an empty-line-free JSON escape mix)."""
    speeches = (SHAKESPEARE / "input.txt").read_text().split("\n\n")[:120]
    return [s + "\n" for s in speeches] + ["naïve “quotes” — ünïcode\tand tabs\n", 'a "json" \\ escape\n']


def _jsonl_bytes(docs, field="text"):
    return "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)).encode()


def write_formats(root, docs):
    """The same documents as a text folder, JSONL (plain, .gz, .zst), Parquet, an Arrow file and a
    datasets.save_to_disk folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    paths = {}
    (root / "text").mkdir()
    for i, d in enumerate(docs):
        (root / "text" / f"doc{i:04d}.txt").write_text(d)
    paths["text"] = root / "text"
    raw = _jsonl_bytes(docs)
    (root / "c.jsonl").write_bytes(raw)
    (root / "c.jsonl.gz").write_bytes(gzip.compress(raw))
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, root / "c.parquet", row_group_size=37)
    with pa.ipc.new_file(str(root / "c.arrow"), table.schema) as w:
        for batch in table.to_batches(max_chunksize=50):
            w.write_batch(batch)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "saved"))
    paths.update({k: root / k for k in ("c.jsonl", "c.jsonl.gz", "c.jsonl.zst", "c.parquet", "c.arrow", "saved")})
    return paths


def shards(corpus, tok, cache_dir, **kw):
    request = ShardRequest(Corpus(list_corpus_files(corpus)) if not isinstance(corpus, Corpus) else corpus, tok,
                           "train", kw.pop("val_fraction", 0.1), **kw)
    path, meta, _ = build_token_shards(request, cache_dir)
    dtype = np.dtype(meta["dtype"])
    return np.fromfile(path / "train.bin", dtype), np.fromfile(path / "val.bin", dtype), meta


def test_every_format_gives_the_same_token_stream(tmp_path, docs, tok, cache_dir):
    paths = write_formats(tmp_path, docs)
    val = tmp_path / "val.jsonl"
    val.write_bytes(_jsonl_bytes(docs[:5]))
    val_corpus = Corpus([val])
    streams = {name: shards(p, tok, cache_dir, val_corpus=val_corpus)[0] for name, p in paths.items()}
    expected = [i for d in docs for i in tok(d)["input_ids"] + [tok.eos_token_id]]
    for name, stream in streams.items():
        assert stream.tolist() == expected, name


def test_documents_are_held_out_whole_by_content_hash_alike_in_every_format(tmp_path, docs, tok, cache_dir):
    paths = write_formats(tmp_path, docs)
    runs = {name: shards(paths[name], tok, cache_dir, val_fraction=0.2)
            for name in ("c.jsonl", "c.jsonl.zst", "c.parquet", "saved")}
    train, val, meta = runs["c.jsonl"]
    for name, (t, v, _) in runs.items():
        assert np.array_equal(t, train) and np.array_equal(v, val), name
    held = [d for d in docs if held_out(d, 0.2)]
    assert 0 < len(held) < len(docs)
    assert val.tolist() == [i for d in held for i in tok(d)["input_ids"] + [tok.eos_token_id]]
    assert meta["data"]["documents_val"] == len(held) and meta["data"]["documents_train"] == len(docs) - len(held)
    assert meta["data"]["tokens_train"] + meta["data"]["tokens_val"] == len(train) + len(val)


def test_tokens_do_not_depend_on_the_number_of_processes(tmp_path, docs, tok, cache_dir):
    path = tmp_path / "c.jsonl"
    path.write_bytes(_jsonl_bytes(docs * 8))
    one = shards(path, tok, tmp_path / "one", num_proc=1)
    two = shards(path, tok, tmp_path / "two", num_proc=2)
    assert np.array_equal(one[0], two[0]) and np.array_equal(one[1], two[1])


def test_validation_documents_the_training_corpus_repeats_are_counted(tmp_path, docs, tok, cache_dir):
    """With data.val_corpus the split is the user's: its documents whose content a training document repeats are
    counted (the summary's data.val_documents_in_train: validation documents, each copy, however often training
    repeats them), alike for any number of tokenizer processes."""
    train_path, val_path = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_path.write_bytes(_jsonl_bytes(docs[:100] + docs[:3] + [docs[99]] * 9))  # docs[99] ten times in training
    val_path.write_bytes(_jsonl_bytes(docs[95:110] + [docs[96]]))  # five of these are training's, one twice
    for num_proc in (1, 2):
        train, val, meta = shards(train_path, tok, tmp_path / f"p{num_proc}", val_corpus=Corpus([val_path]),
                                  num_proc=num_proc)
        assert meta["data"]["val_documents_in_train"] == 6 and meta["data"]["documents_val"] == 16
        assert meta["data"]["val_files_in_train"] == 0 and meta["data"]["documents_train"] == 112
        # validation is read first now: the streams are the corpus's, in order, as before
        assert train.tolist() == [i for d in docs[:100] + docs[:3] + [docs[99]] * 9
                                  for i in tok(d)["input_ids"] + [tok.eos_token_id]]
        assert val.tolist() == [i for d in docs[95:110] + [docs[96]] for i in tok(d)["input_ids"] + [tok.eos_token_id]]
    _, _, meta = shards(train_path, tok, tmp_path / "held", val_fraction=0.2)
    assert "val_documents_in_train" not in meta["data"]  # held out by hash: a document is on one side only


def test_validation_files_that_are_training_files_are_counted_and_new_runs_naming_one_refused(tmp_path, docs, tok,
                                                                                            cache_dir, monkeypatch):
    from training.config import DataSpec, SpecError, check_new_run_data
    from training.data import TokenDataset

    books, other = tmp_path / "books", tmp_path / "other"
    books.mkdir()
    other.mkdir()
    for i in range(3):
        (books / f"part{i}.jsonl").write_bytes(_jsonl_bytes(docs[40 * i:40 * (i + 1)]))
    (books / "empty.jsonl").write_bytes(b"")
    (other / "copy.jsonl").write_bytes((books / "part1.jsonl").read_bytes())
    (other / "own.jsonl").write_bytes(_jsonl_bytes(docs[120:]))
    (other / "zzz.jsonl").write_bytes(b"")  # empty, like books/empty.jsonl: not "the same text"
    kw = dict(seq_len=16, val_fraction=0.1, cache_dir=cache_dir)
    # stored runs are not refused: what they share is counted (a file, and its documents)
    ds = TokenDataset.from_corpus(books, tok, val_corpus=other, **kw)
    assert ds.info["val_files_in_train"] == 1 and ds.info["val_documents_in_train"] == 40
    assert ds.info["val_files_in_train_examples"] == [f"{other / 'copy.jsonl'} (the same bytes as "
                                                      f"{books / 'part1.jsonl'})"]
    same = TokenDataset.from_corpus(books, tok, val_corpus=books / "part2.jsonl", **kw)
    assert same.info["val_files_in_train"] == 1 and same.info["val_documents_in_train"] == 40
    # a text validation corpus: files compared, documents not (one document per file; pieces are not compared)
    (other / "t.txt").write_text("some held-out words\n" * 50)
    text_val = TokenDataset.from_corpus(books, tok, val_corpus=other / "t.txt", **kw)
    assert text_val.info["val_files_in_train"] == 0 and "val_documents_in_train" not in text_val.info

    monkeypatch.setenv("PLAB_DATA_DIR", str(tmp_path))
    with pytest.raises(SpecError, match=r"data.val_corpus shares 1 of its 1 file\(s\) with data.corpus: "
                                        r".*books/part2.jsonl. Its val loss would be measured on text the run trains"):
        check_new_run_data(DataSpec(corpus="books", val_corpus="books/part2.jsonl"))
    check_new_run_data(DataSpec(corpus="books", val_corpus="other"))  # the copy's bytes are read when tokenizing


def test_bos_is_packed_where_the_tokenizer_template_adds_one(tmp_path, docs, tok, cache_dir):
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    backend = tok.backend_tokenizer.__class__.from_str(tok.backend_tokenizer.to_str())
    backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 512)])
    backend.add_special_tokens(["<s>"])
    with_bos = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|endoftext|>")
    path = tmp_path / "c.jsonl"
    path.write_bytes(_jsonl_bytes(docs[:10]))
    train, _, _ = shards(path, with_bos, cache_dir, val_corpus=Corpus([path]))
    assert train.tolist() == [i for d in docs[:10] for i in [512] + tok(d)["input_ids"] + [tok.eos_token_id]]


def test_a_line_without_the_text_field_names_the_file_and_row(tmp_path, tok, cache_dir):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two"}\n{"body": "three"}\n')
    with pytest.raises(CorpusError, match=r"c\.jsonl:4: the line has no field 'text' \(fields: \['body'\]\)"):
        shards(path, tok, cache_dir)


def test_a_null_text_is_called_null_not_a_missing_field(tmp_path, tok, cache_dir):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "one"}\n{"text": null, "id": 1}\n')
    with pytest.raises(CorpusError, match=r"c\.jsonl:2: the line has 'text': null \(no text\) \(fields: \['id', "
                                          r"'text'\]\)"):
        shards(path, tok, cache_dir)


def test_a_null_in_a_parquet_column_names_the_row(tmp_path, tok, cache_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), tmp_path / "c.parquet")
    with pytest.raises(CorpusError, match=r"c\.parquet: row 3 has no 'text'"):
        shards(tmp_path / "c.parquet", tok, cache_dir)


def _with_bad_lines(tmp_path, docs, n_good):
    lines = [json.dumps({"text": docs[i % len(docs)]}).encode() for i in range(n_good)]
    lines.insert(10, b'{"text": "unterminated')
    lines.insert(500, b'{"text": "caf\xe9 latin-1"}')
    lines.insert(700, b'{"text": "lone \\ud800 surrogate"}')
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_lines_are_counted_named_and_skipped_below_the_threshold(tmp_path, docs, tok, cache_dir):
    path = _with_bad_lines(tmp_path, docs, 998)
    _, _, meta = shards(path, tok, cache_dir, max_bad_fraction=0.01)
    data = meta["data"]
    assert data["bad_lines"] == 3 and data["rows"] == 1001
    assert data["documents_train"] + data["documents_val"] == 998
    assert data["bad_examples"][0].endswith("c.jsonl:11: invalid JSON (Unterminated string starting at: line 1 column 10 (char 9))")
    assert data["bad_examples"][1].endswith("c.jsonl:501: bytes that are not UTF-8 at column 14")
    assert data["bad_examples"][2].endswith("c.jsonl:701: the text is not valid Unicode (a lone surrogate at "
                                            "character 6)")


def test_bad_lines_above_the_threshold_fail_the_build_and_leave_no_cache(tmp_path, docs, tok):
    path = _with_bad_lines(tmp_path, docs, 998)
    with pytest.raises(CorpusError, match=r"3 of 1,001 lines .* more than data\.max_bad_fraction \(0\.001\); "
                                          r"first: .*c\.jsonl:11: invalid JSON"):
        shards(path, tok, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache" / "shards").iterdir() if not p.name.endswith(".lock")] == []


def test_undecodable_bytes_in_text_files_are_counted_named_and_held_to_the_threshold(tmp_path, docs, tok,
                                                                                         cache_dir):
    """Text files keep their tokens (U+FFFD where bytes are not UTF-8, as errors="replace" gives) and the bad
    bytes count like bad JSON lines: against the text's lines, named by file and offset."""
    folder = tmp_path / "texts"
    folder.mkdir()
    clean = "".join(docs).encode()
    (folder / "a.txt").write_bytes(clean)
    (folder / "b.txt").write_bytes(clean[:40] + b"\xff\xfe" + clean[40:80] + b"\xe2\x82 tail\n")
    lines = sum(len(f.read_bytes().splitlines()) for f in folder.iterdir())
    _, _, meta = shards(folder, tok, cache_dir, max_bad_fraction=0.01)
    data = meta["data"]
    # one count per replacement character: \xff and \xfe each, and the truncated \xe2\x82 sequence
    assert data["bad_lines"] == 3 and data["rows"] == lines
    assert data["bad_examples"] == [f"b.txt: bytes that are not UTF-8 near byte {n}" for n in (40, 41, 82)]
    with pytest.raises(CorpusError, match=rf"3 of {lines:,} lines .* more than data\.max_bad_fraction \(0\.0001\); "
                                          r"first: b\.txt: bytes that are not UTF-8 near byte 40"):
        shards(folder, tok, tmp_path / "cache2", max_bad_fraction=0.0001)
    # the same tokens as before: the undecodable bytes are the replacement character
    text = (folder / "b.txt").read_bytes().decode("utf-8", errors="replace")
    assert text.count("\ufffd") == 3


def test_local_tokenizers_load_from_a_folder_or_a_bare_tokenizer_json(tmp_path, tok):
    from training.tokenizer import load_tokenizer

    tok.save_pretrained(tmp_path / "ckpt")
    for source, init_from in (("checkpoint", tmp_path / "ckpt"), (str(tmp_path / "ckpt"), None),
                              (str(tmp_path / "ckpt" / "tokenizer.json"), None)):
        loaded = load_tokenizer(source, init_from=init_from)
        assert loaded.eos_token == "<|endoftext|>" and loaded.get_vocab() == tok.get_vocab()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_tokenizer(str(tmp_path / "empty"))


def test_a_corpus_that_is_not_json_lines_fails_before_it_is_read_to_the_end(tmp_path, tok, monkeypatch):
    from training import corpus as corpus_module

    monkeypatch.setattr(corpus_module, "BLOCK_BYTES", 4096)  # many units, so the check runs between them
    path = tmp_path / "c.jsonl"
    path.write_text("".join(f"id,text\n{i},plain csv line {i}\n" for i in range(20_000)))
    units_read = []
    original = corpus_module.Corpus.units

    def counted(self, split, **kw):
        for unit in original(self, split, **kw):
            units_read.append(unit)
            yield unit
    monkeypatch.setattr(corpus_module.Corpus, "units", counted)
    with pytest.raises(CorpusError, match="could not be read"):
        shards(path, tok, tmp_path / "cache", num_proc=1)
    assert len(units_read) < path.stat().st_size / 4096 / 2


def _killed(unit):
    os._exit(9)  # what the kernel's OOM killer does to a tokenizer process


def test_a_tokenizer_process_that_dies_fails_the_build_instead_of_hanging(tmp_path, docs, tok, monkeypatch):
    from training import shards as shards_module

    path = tmp_path / "c.jsonl"
    path.write_bytes(_jsonl_bytes(docs))
    monkeypatch.setattr(shards_module, "encode_unit", _killed)  # the forked workers inherit it
    with pytest.raises(RuntimeError, match="a tokenizer process died"):
        shards(path, tok, tmp_path / "cache", num_proc=2)


def test_an_empty_corpus_is_a_clear_error(tmp_path, tok, cache_dir):
    path = tmp_path / "c.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(CorpusError, match="has no documents"):
        shards(path, tok, cache_dir)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not a corpus file")
    with pytest.raises(CorpusError, match="folder .*notes' has no corpus files"):
        list_corpus_files(tmp_path / "notes")


def test_a_text_corpus_too_short_to_split_or_to_fill_a_window_says_so(tmp_path, tok, cache_dir):
    from training.data import TokenDataset

    short = tmp_path / "short.txt"
    short.write_text("a few words")
    with pytest.raises(CorpusError, match=r"the corpus \(\S*short.txt\) has \d+ tokens, too few for data.val_fraction "
                                          r"0.02 of them to make a validation split; use a larger corpus"):
        shards(short, tok, cache_dir, val_fraction=0.02)
    train, val, _ = shards(short, tok, cache_dir, val_fraction=0.5)
    assert len(val) > 0
    with pytest.raises(CorpusError, match=f"the training split has {len(train)} tokens, fewer than one window of "
                                          "seq_len\\+1 = 65; use a larger corpus or a smaller data.seq_len"):
        TokenDataset(train, val, seq_len=64, vocab_size=512)


def test_a_training_run_on_jsonl_reports_progress_and_records_its_data(tmp_path, docs, make_spec, cache_dir,
                                                                        monkeypatch):
    from training.train import train

    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(docs * 4, field="body")))
    sink = ListSink()
    spec = make_spec(data={"corpus": str(tmp_path / "books" / "*.jsonl.gz"), "text_field": "body",
                           "val_fraction": 0.1, "tokenizer": str(tmp_path / "tok")},
                     training={"steps": 2, "val_every": 0})
    get_tokenizer(SHAKESPEARE, 512, cache_dir).save_pretrained(tmp_path / "tok")
    result = train(spec, sink, cache_dir=cache_dir / "jsonl-run")
    assert result.status == "succeeded"
    progress = sink.events_of("data_progress")
    assert progress[-1]["done"] and progress[-1]["documents"] == len(docs) * 4
    assert progress[-1]["tokens"] > 0 and progress[-1]["fraction"] == 1.0
    data = result.summary["data"]
    assert data["files"] == 1 and data["documents_train"] + data["documents_val"] == len(docs) * 4
    assert data["tokenizer"] == str(tmp_path / "tok") and data["bad_lines"] == 0
    # what the val loss is the mean over: val_batches x batch_size windows spread over the held-out documents
    t, seq_len = spec["training"], spec["data"].get("seq_len", 128)
    validation = result.summary["validation"]
    wanted = t.get("val_batches", 4) * t.get("batch_size", 8)
    assert validation["windows"] == min(wanted, validation["split_windows"]) > 0 and validation["rule"] == "spread"
    assert validation["tokens"] == validation["windows"] * seq_len
    assert validation["split_windows"] == (validation["split_tokens"] - 1) // seq_len
    assert sink.events_of("run_info")[0]["validation"] == validation


def test_a_line_without_the_text_field_is_the_corpus_error_not_the_tokenizers(make_spec, cache_dir, tmp_path):
    """Found while the tokenizer trains on the corpus, it was reported as `data.tokenizer: ...` (a review)."""
    import json

    from training.config import SpecError
    from training.sink import ListSink
    from training.train import train

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"body": "words " * 30}) + "\n" for _ in range(40)))
    with pytest.raises(SpecError) as err:
        train(make_spec(data={"corpus": str(corpus)}), ListSink(), cache_dir=cache_dir)
    assert str(err.value).startswith(f"{corpus}:1: the line has no field 'text' (fields: ['body']); set "
                                     "data.text_field")
