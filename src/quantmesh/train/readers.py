"""Data files and folders -> records, streamed: JSONL line by line, a JSON array a record at a
time (pieces of the file, each element decoded once whole), CSV and TSV a row at a time (the
header row names the columns), Parquet and Arrow by record batch, a `datasets` folder
(`save_to_disk`) memory-mapped; a plain text file is one record. JSONL, JSON, CSV, TSV and text
files may be compressed with gzip, bzip2 or xz (found by their first bytes: `train.jsonl.gz`);
they are decompressed as they are read.

A path is a file, a folder saved by `datasets` (`dataset_info.json` + `state.json`, or a
`dataset_dict.json` of splits: its "train" split), or a folder of shards: its data files
(.jsonl, .ndjson, .json, .csv, .tsv, .parquet, .arrow, .txt, and the first five and .txt with
.gz, .bz2 or .xz after them) and the `datasets` folders inside it, recursively, in name order;
any other file there is listed as skipped.

Example:
    >>> sources, skipped = expand(["shards/"])        # doctest: +SKIP
    >>> for pos, record in records(sources[0]):        # doctest: +SKIP
    ...     print(sources[0].where(pos), sorted(record))
    shards/part-0.parquet row 0 ['messages']
"""

from __future__ import annotations

import bz2
import codecs
import csv
import gzip
import io
import json
import lzma
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

from .formats import DataError

__all__ = ["Source", "data_name", "expand", "records"]

_TEXT_EXTS = {".txt", ".text", ".md", ".rst"}
_FOLDER_EXTS = {".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet", ".arrow", ".txt"}
_BATCH = 1024  # rows per record batch read from Parquet / Arrow / datasets
# compressed files, by their first bytes; a folder reads these suffixes after a data file's
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"),
          (b"\x28\xb5\x2f\xfd", "zstd"))  # fmt: skip
_COMPRESSED_EXTS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}


@dataclass(frozen=True)
class Source:
    """One readable unit: a file or a `datasets` folder, and how it is read."""

    path: Path
    kind: str
    """"text", "jsonl", "json", "csv", "tsv", "parquet", "arrow" or "datasets"."""
    split: str | None = None
    """The split read from a DatasetDict folder."""
    compression: str | None = None
    """"gzip", "bzip2" or "xz": the file is decompressed as it is read."""

    def open(self) -> BinaryIO:
        """The file's bytes, decompressed.

        Example:
            >>> Source(Path("a.jsonl.gz"), "jsonl", compression="gzip").open().readline()  # doctest: +SKIP
            b'{"text": "hello"}\\n'
        """  # noqa: E501
        if self.compression == "gzip":
            return cast(BinaryIO, gzip.open(self.path, "rb"))
        if self.compression == "bzip2":
            return cast(BinaryIO, bz2.open(self.path, "rb"))
        if self.compression == "xz":
            return cast(BinaryIO, lzma.open(self.path, "rb"))
        return self.path.open("rb")

    def where(self, pos: int) -> str:
        """Names record `pos` in errors: a JSONL line (from 1), else a row (from 0)."""
        if self.kind == "jsonl":
            return f"{self.path} line {pos}"
        split = f" (split {self.split!r})" if self.split else ""
        return f"{self.path}{split} row {pos}"

    @property
    def tabular(self) -> bool:
        """Parquet, Arrow and datasets: one schema for every row."""
        return self.kind in ("parquet", "arrow", "datasets")


def _is_datasets_folder(d: Path) -> bool:
    return (d / "dataset_dict.json").is_file() or (
        (d / "dataset_info.json").is_file() and (d / "state.json").is_file()
    )


def expand(paths: Sequence[str | Path]) -> tuple[list[Source], list[Path]]:
    """The sources named by files and folders, and the files skipped inside folders.

    Example:
        >>> expand(["train.parquet"])  # doctest: +SKIP
        ([Source(path=PosixPath('train.parquet'), kind='parquet', split=None)], [])
    """
    sources: list[Source] = []
    skipped: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(
                f"data path {str(p)!r} does not exist; check the path" + _hub_hint(p)
            )
        if p.is_dir():
            found = _walk(p, skipped)
            if not found:
                held = ", ".join(sorted(c.name for c in p.iterdir())[:10]) or "nothing"
                raise DataError(
                    f"{p}: a folder without data files ({', '.join(sorted(_FOLDER_EXTS))}) or "
                    f"datasets folders; it holds: {held}"
                )
            sources += found
        else:
            sources.append(_file_source(p))
    return sources, skipped


def _hub_hint(p: Path) -> str:
    """For a missing path shaped like a Hub dataset id (`owner/name`): how to make it a folder."""
    parts = str(p).split("/")
    if len(parts) != 2 or not all(parts) or p.suffix or str(p).startswith((".", "~")):
        return ""
    return (
        f" (--data reads local files; if {str(p)!r} is a Hugging Face Hub dataset, save it "
        'first: python -c "import datasets; datasets.load_dataset('
        f"'{p}', split='train').save_to_disk('{parts[1]}')\" and pass --data {parts[1]})"
    )


def _walk(d: Path, skipped: list[Path]) -> list[Source]:
    if _is_datasets_folder(d):
        return [_datasets_source(d)]
    out: list[Source] = []
    for c in sorted(d.iterdir()):
        if c.is_dir():
            out += _walk(c, skipped)
        elif data_name(c.name) and not c.name.startswith("."):
            out.append(_file_source(c))
        else:
            skipped.append(c)
    return out


def _datasets_source(d: Path) -> Source:
    if not (d / "dataset_dict.json").is_file():
        return Source(d, "datasets")
    splits = json.loads((d / "dataset_dict.json").read_text()).get("splits", [])
    if "train" in splits or len(splits) == 1:
        return Source(d, "datasets", "train" if "train" in splits else splits[0])
    raise DataError(
        f"{d}: a DatasetDict with the splits {splits} and none named 'train'; pass the split's "
        f"folder, e.g. {d / splits[0]}"
        if splits
        else f"{d}: a DatasetDict without splits"
    )


def data_name(name: str) -> bool:
    """Whether a file in a folder is data by its name: a data file's suffix, or one followed by a
    compression suffix (Parquet and Arrow compress their own pages).

    Example:
        >>> data_name("chat.jsonl.gz"), data_name("run.toml")
        (True, False)
    """
    path = Path(name.lower())
    if path.suffix in _COMPRESSED_EXTS:
        path = Path(path.stem)
        return path.suffix in _FOLDER_EXTS - {".parquet", ".arrow"}
    return path.suffix in _FOLDER_EXTS


def _file_source(p: Path) -> Source:
    """How file `p` is read: its compression by its first bytes, then its kind by its first
    bytes decompressed (Parquet, Arrow), its name (the suffix under a compression suffix) and its
    first characters."""
    with p.open("rb") as f:
        raw = f.read(8)
    compression = next((name for magic, name in _MAGIC if raw.startswith(magic)), None)
    if compression == "zstd":
        raise DataError(
            f"{p}: compressed with zstd, which quantmesh does not read; decompress it first "
            f"(zstd -d {p.name}), or compress it with gzip, bzip2 or xz"
        )
    name = Path(p.name.lower())
    if compression is not None:  # the data file's suffix is the one under the compression's
        name = Path(name.stem) if name.suffix in _COMPRESSED_EXTS else Path("")
    src = Source(p, "text", compression=compression)
    try:
        kind = _file_kind(src, name.suffix)
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise _unreadable(src, e) from None
    if compression is not None and kind in ("parquet", "arrow"):
        raise DataError(
            f"{p}: a {kind} file compressed with {compression}; decompress it and pass the "
            f".{kind} file itself ({kind} compresses its own pages)"
        )
    return Source(p, kind, compression=compression)


def _unreadable(src: Source, e: BaseException) -> BaseException:
    """The error reading `src` raised: a compressed file that does not decompress is the data's
    fault, said as a DataError; anything else is raised as it is."""
    if src.compression is None:
        return e
    return DataError(f"{src.path}: not a readable {src.compression} file ({e})")


def _file_kind(src: Source, ext: str) -> str:
    """The kind of a file from its first bytes (decompressed) and `ext`, the suffix of its data
    file's name."""
    with src.open() as f:
        head = f.read(4096)
    # by content first: a Parquet or Arrow file is never read as text
    if head[:4] == b"PAR1" or ext == ".parquet":
        return "parquet"
    if head[:6] == b"ARROW1" or head[:4] == b"\xff\xff\xff\xff" or ext == ".arrow":
        return "arrow"
    if ext in _TEXT_EXTS:
        return "text"
    if ext in (".jsonl", ".ndjson"):
        return "jsonl"
    if ext in (".csv", ".tsv"):
        return ext[1:]
    start = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if start[:1] == b"[" and ext == ".json":
        return "json"
    if ext == ".json":
        return "jsonl"
    # no known extension: JSONL when the first line is a JSON object, else text
    first = start.split(b"\n", 1)[0]
    try:
        return "jsonl" if isinstance(json.loads(first), dict) else "text"
    except ValueError:
        return "text"


def records(src: Source) -> Iterator[tuple[int, Any]]:
    """(position, record) pairs of one source, streamed; a text file gives one {"text": ...}.

    Example:
        >>> next(records(Source(Path("a.jsonl"), "jsonl")))  # doctest: +SKIP
        (1, {'text': 'hello'})
    """
    if src.kind in ("parquet", "arrow", "datasets"):
        yield from _tabular(src)
        return
    try:
        if src.kind == "text":
            with src.open() as f:
                text = _decode(src.path, f.read(), 0)
            if text.strip():
                yield 0, {"text": text}
        elif src.kind == "jsonl":
            yield from _jsonl(src)
        elif src.kind == "json":
            yield from _json_array(src)
        else:
            yield from _csv(src)
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise _unreadable(src, e) from None


_CSV_FIELD = 1 << 30  # characters a CSV field may hold (the csv module's default: 131,072)


def _csv(src: Source) -> Iterator[tuple[int, Any]]:
    """The rows of a CSV (TSV: tab-separated) file with a header row, as {column: text}, one at a
    time; an empty cell is None (no value). Every row must have the header's number of fields."""
    if csv.field_size_limit() < _CSV_FIELD:
        csv.field_size_limit(_CSV_FIELD)  # long documents in a text column
    with src.open() as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")
        reader = csv.reader(text, delimiter="\t" if src.kind == "tsv" else ",")
        try:
            header = next(reader, None)
            if header is None:
                return
            if len(set(header)) != len(header) or any(not h.strip() for h in header):
                raise DataError(
                    f"{src.path}: the header row {header} has empty or repeated column names; "
                    "the first row must name each column once"
                )
            for pos, row in enumerate(reader):
                if not row:
                    continue  # a blank line
                if len(row) != len(header):
                    raise DataError(
                        f"{src.where(pos)} (line {reader.line_num}): {len(row)} fields, but the "
                        "header has "
                        f"{len(header)} ({', '.join(header)}); quote fields that hold a "
                        f"{'tab' if src.kind == 'tsv' else 'comma'}"
                    )
                # an empty cell is CSV's only null: no value, as a missing key or a null is
                yield pos, {h: v if v != "" else None for h, v in zip(header, row, strict=True)}
        except UnicodeDecodeError as e:
            raise DataError(
                f"{src.path}: expected UTF-8 text, found byte 0x{e.object[e.start]:02x} that is "
                "not valid UTF-8; re-save the file as UTF-8"
            ) from None
        except csv.Error as e:
            raise DataError(
                f"{src.path} line {reader.line_num}: not readable as {src.kind.upper()} ({e})"
            ) from None


def _decode(path: Path, raw: bytes, line0: int) -> str:
    try:
        return raw.decode("utf-8-sig" if line0 <= 1 else "utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as e:
        line = line0 or raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path} line {line}: expected UTF-8 text, found byte 0x{raw[e.start]:02x} at offset "
            f"{e.start}{' of the line' if line0 else ''} that is not valid UTF-8; re-save the "
            "file as UTF-8"
        ) from None


def _json_array(src: Source) -> Iterator[tuple[int, Any]]:
    """The records of a JSON array, one at a time: the file is read in pieces and each element
    decoded as soon as it is whole (`JSONDecoder.raw_decode`), so a rank holds one record and
    one piece of the file, never the whole of it."""
    text = _JsonText(src)
    decoder = json.JSONDecoder()
    try:
        if text.next_char() != "[":
            raise text.error(0, "expected '[' (a JSON array of records, or JSONL: one per line)")
        text.pos += 1
        index = 0
        sep = text.next_char()
        if sep == "]":  # an empty array
            text.pos += 1
        while sep != "]":
            while True:
                try:
                    obj, end = decoder.raw_decode(text.buf, text.pos)
                except json.JSONDecodeError as e:
                    if text.more():  # the element may go on past what was read
                        continue
                    text.pos = e.pos
                    raise text.error(index, e.msg) from None
                # a number that ends where the text read so far ends may go on after it
                if end < len(text.buf) or not text.more():
                    break
            yield index, obj
            index += 1
            text.pos = end
            sep = text.next_char()
            if sep not in (",", "]"):
                raise text.error(index - 1, "expected ',' or ']' after the record")
            text.pos += 1
            if sep == "," and text.next_char() == "]":
                raise text.error(index, "expected a record after ','")
        if text.next_char():
            raise text.error(index, "extra data after the array")
    finally:
        text.close()


_JSON_READ = 1 << 20  # bytes read at a time from a JSON array (more while one record is longer)


class _JsonText:
    """The text of a JSON file read so far: `buf[pos:]` is still to be parsed; `more()` reads on,
    dropping the text before `pos`. Keeps the line and column of `pos` for errors."""

    def __init__(self, src: Source):
        self.path = src.path
        self.buf = ""
        self.pos = 0
        self._file = src.open()
        self._decoder = codecs.getincrementaldecoder("utf-8-sig")()
        self._bytes = 0  # bytes read
        self._byte_lines = 0  # newlines in the bytes read
        self._lines = 0  # newlines in the text dropped
        self._column = 0  # characters dropped since the last newline dropped
        self._eof = False

    def more(self) -> bool:
        """Read on: at least as much as is pending, so that one long record is parsed a bounded
        number of times; False at the end of the file."""
        if self._eof:
            return False
        dropped = self.buf[: self.pos]
        newlines = dropped.count("\n")
        self._lines += newlines
        self._column = (
            len(dropped) - dropped.rfind("\n") - 1 if newlines else self._column + len(dropped)
        )
        self.buf, self.pos = self.buf[self.pos :], 0
        raw = self._file.read(max(_JSON_READ, len(self.buf)))
        try:
            self.buf += self._decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            data = e.object  # the bytes decoded: a partial character left from before, then raw
            line = self._byte_lines + data.count(b"\n", 0, e.start) + 1
            offset = self._bytes - (len(data) - len(raw)) + e.start
            raise DataError(
                f"{self.path} line {line}: expected UTF-8 text, found byte 0x{data[e.start]:02x} "
                f"at offset {offset} that is not valid UTF-8; re-save the file as UTF-8"
            ) from None
        self._bytes += len(raw)
        self._byte_lines += raw.count(b"\n")
        self._eof = not raw
        return True

    def next_char(self) -> str:
        """The next character that is not white space ("" at the end), `pos` moved onto it."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos : self.pos + 1]

    def error(self, index: int, msg: str) -> DataError:
        """Invalid JSON at `pos`, in record `index`."""
        newlines = self.buf.count("\n", 0, self.pos)
        line = self._lines + newlines + 1
        column = (self.pos - self.buf.rfind("\n", 0, self.pos) - 1 if newlines
                  else self._column + self.pos) + 1  # fmt: skip
        return DataError(
            f"{self.path} row {index}: expected a JSON array of records; got invalid JSON "
            f"({msg}: line {line} column {column})"
        )

    def close(self) -> None:
        self._file.close()


def _jsonl(src: Source) -> Iterator[tuple[int, Any]]:
    path = src.path
    with src.open() as f:
        for lineno, raw in enumerate(f, start=1):
            line = _decode(path, raw, lineno).strip()
            if not line:
                continue  # blank lines (a trailing newline, spacing) carry nothing
            try:
                yield lineno, json.loads(line)
            except ValueError as e:
                snippet = line if len(line) <= 60 else line[:57] + "..."
                raise DataError(
                    f"{path} line {lineno}: expected one JSON object per line; got invalid JSON "
                    f"({e}): {snippet!r}"
                ) from None


def _tabular(src: Source) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow as pa
        import pyarrow.ipc
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{src.path}: reading {src.kind} data needs pyarrow and datasets; "
            "pip install 'quantmesh[data]'"
        ) from None
    pos = 0
    try:
        if src.kind == "parquet":
            batches: Iterator[Any] = pq.ParquetFile(src.path).iter_batches(batch_size=_BATCH)
        elif src.kind == "arrow":
            batches = _arrow_batches(pa, src.path)
        else:
            batches = _datasets_batches(src)
        for batch in batches:
            for row in batch.to_pylist():
                yield pos, row
                pos += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{src.path}: not a readable {src.kind} file ({e})") from None


def _arrow_batches(pa: Any, path: Path) -> Iterator[Any]:
    with pa.memory_map(str(path)) as mm:
        try:
            reader = pa.ipc.open_file(mm)
        except pa.ArrowInvalid:  # the stream format (what datasets writes)
            mm.seek(0)
            yield from pa.ipc.open_stream(mm)
            return
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def _datasets_batches(src: Source) -> Iterator[Any]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{src.path}: a datasets folder needs the datasets package; "
            "pip install 'quantmesh[data]'"
        ) from None
    ds = datasets.load_from_disk(str(src.path))  # memory-mapped: rows are read as iterated
    if isinstance(ds, datasets.DatasetDict):
        assert src.split is not None  # a DatasetDict source names its split
        ds = ds[src.split]
    yield from ds.with_format("arrow").iter(batch_size=_BATCH)
