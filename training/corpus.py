"""A corpus: the files `data.corpus` names and the documents in them, read as a bounded stream.

Formats, by file name:
  * text files (`.txt`, `.text`, optionally `.gz`): the whole file is one document (the lab's first format);
  * JSON lines (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`): one JSON object per line, the document in `text_field`;
  * Parquet (`.parquet`) and Arrow IPC files or streams (`.arrow`, what `datasets.save_to_disk` writes):
    one document per row, in the column `text_field`.

`data.corpus` is a name under the data directory, a path (a file, a folder of files, a `save_to_disk`
folder) or a glob (`books/**/*.jsonl.zst`). Files are read in sorted path order (a `save_to_disk` folder in
the order its state.json lists), which fixes the token stream.

Reading cuts the files into *units* of about a megabyte - a piece of a text file, a block of whole JSON lines
as raw bytes, a slice of a table column - that `training.tokenize.encode_unit` turns into tokens, in worker
processes: JSON is parsed and bytes are decoded where the tokens are made, so the reading process only moves
bytes. Nothing holds more than a few units of a file in memory.
"""
from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

TEXT_SUFFIXES = (".txt", ".txt.gz", ".text", ".text.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TABLE_SUFFIXES = (".parquet", ".arrow")
DOCUMENT_SUFFIXES = JSONL_SUFFIXES + TABLE_SUFFIXES
GLOB_CHARS = "*?["
# A text piece: the unit a long document is encoded in (see `text_pieces`); a JSON block: whole lines.
PIECE_CHARS = 1 << 20
BLOCK_BYTES = 1 << 20
TABLE_ROWS = 1024


class CorpusError(ValueError):
    """The corpus cannot be read as asked; the message names the file (and row) and says what to change."""


def file_format(path: Path) -> str | None:
    """"text", "jsonl", "parquet", "arrow", or None for a file that is not part of a corpus (SOURCE.md)."""
    name = path.name
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    return None


def is_glob(value: str) -> bool:
    return any(c in value for c in GLOB_CHARS)


def list_corpus_files(path: Path, *, field: str = "data.corpus") -> list[Path]:
    """The corpus files of a resolved path: the file itself, a folder's files (non-recursive; a
    `save_to_disk` folder's Arrow files in its own order), or a glob's matches - sorted. A path the system
    refuses to look at (a name too long, no permission) is a CorpusError too."""
    try:
        return _list_corpus_files(path, field)
    except OSError as e:
        raise CorpusError(f"{field} {str(path)[:300]!r} cannot be read: {e.strerror or e}; give a name under "
                          f"PLAB_DATA_DIR, a path or a glob") from None


def _list_corpus_files(path: Path, field: str) -> list[Path]:
    text = str(path)
    if is_glob(text):
        matches = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        files = [p for p in matches if file_format(p)]
        if not files:
            raise CorpusError(f"{field} glob {text!r} matches no corpus files (endings: "
                              f"{', '.join(TEXT_SUFFIXES + DOCUMENT_SUFFIXES)})")
        return files
    if path.is_file():
        if file_format(path) is None:
            raise CorpusError(f"{field} file {text!r} is not a corpus format; use one of "
                              f"{', '.join(TEXT_SUFFIXES + DOCUMENT_SUFFIXES)}")
        return [path]
    if not path.is_dir():
        raise CorpusError(f"{field} {text!r} does not exist; give a name under PLAB_DATA_DIR (a relative path is read "
                          f"from there, not from the current folder), an absolute path or a glob")
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise CorpusError(f"{field} {text!r} is a datasets DatasetDict; name one split's folder, e.g. "
                          f"{str(path / (splits[0] if splits else 'train'))!r}")
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        state = json.loads((path / "state.json").read_text())
        return [path / f["filename"] for f in state.get("_data_files", [])]
    files = sorted(p for p in path.iterdir() if p.is_file() and file_format(p))
    if not files:
        raise CorpusError(f"{field} folder {text!r} has no corpus files (endings: "
                          f"{', '.join(TEXT_SUFFIXES + DOCUMENT_SUFFIXES)})")
    return files


@dataclass
class Unit:
    """One piece of work for a tokenizer process. `kind`: "text" (a piece of a text file: `payload` a str;
    `first`/`last` mark the document's start and end), "jsonl" (`payload` whole lines as bytes, the first
    being row `first_row`, 1-based) or "table" (`payload` a pyarrow string array, rows from `first_row`)."""
    kind: str
    file: int                  # index into the corpus's file list
    payload: object
    first_row: int = 1
    first: bool = True
    last: bool = True
    position: float = 0.0      # the fraction of the file read once this unit is done (progress)
    split: str = "hash"        # "hash" (documents held out by hash), "tail" (text files), "train", "val"
    bad: tuple = ()            # text files: where this piece held bytes that are not UTF-8 ("file: near byte N")


@dataclass
class Corpus:
    """The files of one corpus and how to read documents out of them."""
    files: list[Path]
    text_field: str = "text"
    folder: Path | None = None          # the folder data.corpus names (None: a file or a glob)
    names: list[str] = field(default_factory=list)
    _hash: str | None = field(default=None, repr=False)
    _file_hashes: list[str] | None = field(default=None, repr=False)

    def __post_init__(self):
        if not self.names:
            self.names = [str(p) for p in self.files]

    def content_hash(self) -> str:
        """SHA-256 of the files' names and bytes as stored, in corpus order (computed once, in the same read as
        each file's own `file_hashes`)."""
        if self._hash is None:
            h, per_file = hashlib.sha256(), []
            for p in self.files:
                h.update(p.name.encode() + b"\0")
                own = hashlib.sha256()
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
                        own.update(chunk)
                h.update(b"\0")
                per_file.append(own.hexdigest())
            self._hash, self._file_hashes = h.hexdigest(), per_file
        return self._hash

    def file_hashes(self) -> list[str]:
        """SHA-256 of each file's bytes as stored, in corpus order."""
        self.content_hash()
        return list(self._file_hashes)

    @property
    def text_only(self) -> bool:
        return all(file_format(p) == "text" for p in self.files)

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)

    def units(self, split: str, *, file_offset: int = 0) -> Iterator[Unit]:
        """Every unit of every file, in order; a text file's split is "tail" when `split` is "hash"."""
        for i, path in enumerate(self.files):
            fmt = file_format(path)
            index = file_offset + i
            if fmt == "text":
                yield from _text_units(path, index, "tail" if split == "hash" else split)
            elif fmt == "jsonl":
                yield from _jsonl_units(path, index, split)
            else:
                yield from _table_units(path, index, self.text_field, split, fmt)

    def texts(self) -> Iterator[str]:
        """The documents as strings, in order, parsed here (tokenizer training reads a prefix only)."""
        for unit in self.units("train"):
            if unit.kind == "text":
                yield unit.payload
            elif unit.kind == "jsonl":
                yield from (t for t in parse_json_lines(unit, self.text_field, self.names)[0] if t)
            else:
                yield from (t for t in table_texts(unit, self.text_field, self.names) if t)


def shared_files(corpus: Corpus, val_corpus: Corpus, *, by_bytes: bool = True) -> list[str]:
    """The validation corpus's files that are also training files: the same file, or (`by_bytes`: every byte is
    read, once, as for the cache key) one with the same non-empty bytes under another name - each as a phrase
    naming it. Their val loss is measured on text the run trains on."""
    def key_bytes(files, hashes):
        return {digest: path for path, digest in zip(files, hashes) if path.stat().st_size > 0}

    paths = {str(Path(p).resolve()): p for p in corpus.files}
    same_bytes = key_bytes(corpus.files, corpus.file_hashes()) if by_bytes else {}
    val_hashes = val_corpus.file_hashes() if by_bytes else [None] * len(val_corpus.files)
    shared = []
    for path, digest in zip(val_corpus.files, val_hashes):
        if str(Path(path).resolve()) in paths:
            shared.append(str(path))
        elif digest in same_bytes and path.stat().st_size > 0:
            shared.append(f"{path} (the same bytes as {same_bytes[digest]})")
    return shared


def check_disjoint(corpus: Corpus, val_corpus: Corpus) -> None:
    """Refuse a new run whose validation corpus names a file of its training corpus (paths only: cheap enough for
    an API request). Runs already stored are not refused: tokenizing counts what they share
    (training.shards: the summary's data.val_files_in_train and data.val_documents_in_train)."""
    shared = shared_files(corpus, val_corpus, by_bytes=False)
    if shared:
        listed = "; ".join(shared[:3]) + (f"; and {len(shared) - 3} more" if len(shared) > 3 else "")
        raise CorpusError(f"data.val_corpus shares {len(shared)} of its {len(val_corpus.files)} file(s) with "
                          f"data.corpus: {listed}. Its val loss would be measured on text the run trains on; give "
                          f"data.val_corpus files that are not in data.corpus, or leave it out to hold out "
                          f"data.val_fraction of the corpus")


def _open_stream(path: Path):
    """(raw file, decompressed byte stream); the raw file's position measures progress."""
    raw = open(path, "rb")
    if path.name.endswith(".gz"):
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")
    if path.name.endswith(".zst"):
        import zstandard
        return raw, zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return raw, raw


def text_pieces(text: str, chunk_chars: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of at most ~`chunk_chars` characters that tokenize exactly like the whole.

    A piece ends right after a newline that follows a non-space character, where the byte-level
    pre-tokenizer ends a pre-token anyway (tested). A cut inside a whitespace run need not: "\\n  cd" splits
    into "\\n", " ", " cd" whole but "\\n  " + "cd" when cut before "cd". A text with no such newline in a
    piece's length is cut at the length (rare: minified or single-line text)."""
    pieces, start = [], 0
    while len(text) - start > chunk_chars:
        end = _cut(text, start, start + chunk_chars)
        pieces.append(text[start:end])
        start = end
    if start < len(text) or not pieces:
        pieces.append(text[start:])
    return pieces


def _cut(text: str, start: int, end: int) -> int:
    nl = text.rfind("\n", start, end)
    while nl > start and text[nl - 1].isspace():
        nl = text.rfind("\n", start, nl - 1)
    return nl + 1 if nl > start else end


# Undecodable bytes of text files become U+FFFD exactly as errors="replace" makes them (the tokens, and so the
# caches, of text corpora stay what they were); this handler also notes where, so they are counted like bad JSON
# lines. Text files are read in one thread (the process that hands out units).
_UNDECODABLE: list[int] = []


def _replace_and_count(exc: UnicodeDecodeError):
    _UNDECODABLE.append(exc.start)
    return "\ufffd", exc.end


codecs.register_error("plab.replace_and_count", _replace_and_count)


def _text_units(path: Path, index: int, split: str) -> Iterator[Unit]:
    """A text file as pieces cut by `text_pieces`'s rule while it streams in (bytes that are not UTF-8
    become U+FFFD, as they always have for text files, and are reported in the unit's `bad`)."""
    size = max(path.stat().st_size, 1)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="plab.replace_and_count")
    raw, stream = _open_stream(path)
    with raw, stream:
        buf, eof, first, read, bad = "", False, True, 0, []
        while True:
            while not eof and len(buf) <= PIECE_CHARS:
                chunk = stream.read(BLOCK_BYTES)
                _UNDECODABLE.clear()
                buf += decoder.decode(chunk, final=not chunk)
                bad += [f"{path.name}: bytes that are not UTF-8 near byte {read + at:,}" for at in _UNDECODABLE]
                read += len(chunk)
                eof = not chunk
            if len(buf) > PIECE_CHARS:
                end = _cut(buf, 0, PIECE_CHARS)
                yield Unit("text", index, buf[:end], first=first, last=False, position=raw.tell() / size,
                           split=split, bad=tuple(bad))
                buf, first, bad = buf[end:], False, []
                continue
            yield Unit("text", index, buf, first=first, last=True, position=1.0, split=split, bad=tuple(bad))
            return


def _jsonl_units(path: Path, index: int, split: str) -> Iterator[Unit]:
    """Blocks of whole lines (raw bytes; a line longer than a block makes a longer block)."""
    size = max(path.stat().st_size, 1)
    raw, stream = _open_stream(path)
    row = 1
    with raw, stream:
        carry = b""
        while True:
            chunk = stream.read(BLOCK_BYTES)
            if not chunk:
                if carry:
                    yield Unit("jsonl", index, carry, first_row=row, position=1.0, split=split)
                return
            buf = carry + chunk
            cut = buf.rfind(b"\n") + 1
            if cut == 0:
                carry = buf
                continue
            yield Unit("jsonl", index, buf[:cut], first_row=row, position=raw.tell() / size, split=split)
            row += buf.count(b"\n", 0, cut)
            carry = buf[cut:]


def _table_units(path: Path, index: int, text_field: str, split: str, fmt: str) -> Iterator[Unit]:
    """Slices of the text column of a Parquet file (read by row group batches) or an Arrow file/stream
    (memory-mapped: only the slices being encoded are paged in)."""
    import pyarrow as pa

    batches, total = _record_batches(path, text_field, fmt)
    row = 1
    for batch in batches:
        column = _text_column(batch, text_field, path)
        for start in range(0, len(column), TABLE_ROWS):
            piece = column.slice(start, TABLE_ROWS)
            if isinstance(piece, pa.ChunkedArray):
                piece = piece.combine_chunks()
            yield Unit("table", index, piece, first_row=row, position=min(1.0, (row + len(piece)) / max(total, 1)),
                       split=split)
            row += len(piece)


def _record_batches(path: Path, text_field: str, fmt: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            pf = pq.ParquetFile(path)
            if text_field not in pf.schema_arrow.names:
                raise CorpusError(f"{path}: no column {text_field!r} (columns: {pf.schema_arrow.names}); set "
                                  f"data.text_field to the column that holds the text")
            return pf.iter_batches(batch_size=16 * TABLE_ROWS, columns=[text_field]), pf.metadata.num_rows
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_file(source)
            return (reader.get_batch(i) for i in range(reader.num_record_batches)), reader.count_rows()
        except pa.ArrowInvalid:
            source.seek(0)
            table = pa.ipc.open_stream(source).read_all()  # zero-copy on the memory map
            return table.to_batches(), table.num_rows
    except (pa.ArrowInvalid, OSError) as exc:
        raise CorpusError(f"{path}: not a readable {fmt} file ({exc})") from None


def _text_column(batch, text_field: str, path: Path):
    import pyarrow as pa

    if text_field not in batch.schema.names:
        raise CorpusError(f"{path}: no column {text_field!r} (columns: {batch.schema.names}); set "
                          f"data.text_field to the column that holds the text")
    column = batch.column(text_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise CorpusError(f"{path}: column {text_field!r} holds {column.type}, not strings; set data.text_field "
                          f"to the column that holds the text")
    return column


# ---- the parsing half (runs in the tokenizer processes) -----------------------------------------------------
def parse_json_lines(unit: Unit, text_field: str, names: list[str]) -> tuple[list[str], list[str], int]:
    """(documents, bad-line descriptions, rows) of a JSON-lines block. Blank lines are skipped; a line that is
    not UTF-8 or not JSON is bad (counted and described, the run decides whether there are too many); a
    line without the text field is an error naming the file and row - the data is not what the spec says."""
    texts, bad = [], []
    rows = 0
    for offset, line in enumerate(unit.payload.split(b"\n")):
        if not line.strip():
            continue
        rows += 1
        row = unit.first_row + offset
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            bad.append(f"{names[unit.file]}:{row}: bytes that are not UTF-8 at column {exc.start + 1}")
            continue
        except json.JSONDecodeError as exc:
            bad.append(f"{names[unit.file]}:{row}: invalid JSON ({exc})")
            continue
        value = obj.get(text_field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            what = ("is not a JSON object" if not isinstance(obj, dict) else f"has no field {text_field!r}"
                    if text_field not in obj else f"has {text_field!r}: null (no text)" if value is None
                    else f"has {text_field!r} of type {type(value).__name__}, not a string")
            keys = f" (fields: {sorted(obj)[:10]})" if isinstance(obj, dict) else ""
            raise CorpusError(f"{names[unit.file]}:{row}: the line {what}{keys}; set data.text_field to the "
                              f"field that holds the text, or fix the line")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON may escape a lone surrogate ("\ud800"): no tokenizer takes it
            bad.append(f"{names[unit.file]}:{row}: the text is not valid Unicode (a lone surrogate at "
                       f"character {exc.start + 1})")
            continue
        texts.append(value)
    return texts, bad, rows


def table_texts(unit: Unit, text_field: str, names: list[str]) -> list[str]:
    """The strings of a table slice; a null is an error naming the file and row."""
    column = unit.payload
    if column.null_count:
        row = unit.first_row + column.is_null().to_pylist().index(True)
        raise CorpusError(f"{names[unit.file]}: row {row} has no {text_field!r} (null); drop the row or set "
                          f"data.text_field to a column without nulls")
    return column.to_pylist()
