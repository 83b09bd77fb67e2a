"""Training data: read files in the formats fine-tuning data comes in, tokenize (conversations
through the chat template), pack into fixed-length examples, batch.

Every rank trains on the same examples (the pipeline is deterministic): `iterate_batches` hands
each dp rank its contiguous share of one global batch, so the global batches do not depend on how
many dp ranks there are. `build_dataset` builds them in this process; with `cache_dir=` it keeps
them in a file there (`train.cache`: safetensors, named by a hash of the files' paths, sizes and
modification times, the tokenizer and every option) and maps that file, so the token ids are pages
of the page cache rather than this process's memory, and a later build with the same inputs reads
no data. `shared_dataset` (collective; what the finetune worker calls) has the local rank 0 of
each host build that file while the other ranks wait on a gloo gather with a timeout, then every
rank maps it: one host tokenizes once and holds the token ids once, however many ranks it runs.
Cached or not, the examples are the same.

Files (`readers`): .jsonl, .json (an array of records), .parquet, .arrow, folders saved by
`datasets` (`save_to_disk`), folders of such shards, and plain text (.txt, .md: one document).
Records are streamed (JSONL by line, a JSON array a record at a time, Parquet / Arrow by record
batch, datasets memory-mapped) and tokenized a chunk at a time; the tokenizing process holds the
token ids, never the parsed records.
Record formats (`formats`): messages (OpenAI / TRL), prompt-completion (TRL, plain or
conversational), alpaca, sharegpt, prompt-response and text, detected per record by its keys or
named with `data_format=`.

What is trained (`train_on`): "assistant" (the default) every assistant turn of a conversation,
with the template's end-of-turn tokens, and the response / completion of a prompt pair; "last" only
the last assistant turn; "all" every token. Plain text is trained everywhere.

Example:
    >>> ds = qm.build_dataset(["chat.jsonl"], tokenizer, seq_len=256, eval_fraction=0.05)  # doctest: +SKIP
    >>> ds = qm.shared_dataset(["chat.jsonl"], tokenizer, 256, cache_dir="out/data-cache")  # doctest: +SKIP
    >>> print(ds.summary())  # doctest: +SKIP
    >>> for batch in qm.iterate_batches(ds.train, 4, dp_rank=0, dp_size=2, seed=0, epoch=0):  # doctest: +SKIP
    ...     loss = model(**batch).loss
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .cache import cache_key
from .cache import entry as cache_entry
from .cache import load as cache_load
from .cache import save as cache_save
from .chat import IGNORE_INDEX, check_chat_tokenizer, encode_chats
from .formats import (
    FORMATS,
    DataError,
    Document,
    detect,
    needs,
    no_format_error,
    to_document,
    used_keys,
)
from .readers import Source, expand, records

__all__ = [
    "IGNORE_INDEX",
    "TRAIN_ON",
    "DataError",
    "Document",
    "FileReport",
    "PackedDataset",
    "build_dataset",
    "iterate_batches",
    "read_documents",
    "scan_data",
    "shared_dataset",
    "steps_per_epoch",
]

TRAIN_ON = ("assistant", "last", "all")
"""The choices of `train_on`."""

# A large plain text is cut before each blank-line run that follows a non-space character, so the
# pieces can be tokenized as one (multi-threaded) batch. For byte-level BPE tokenizers (GPT-2 style
# pre-tokenizer regex: SmolLM2, Llama 3, Qwen...) no pre-token spans such a cut, so the tokens are
# identical to tokenizing the whole file in one call.
_CUT = re.compile(r"(?<!\s)(?=\n\n)")
_PIECE_CHARS = 8192  # pieces are merged back up to about this many characters
_CHUNK = 512  # documents tokenized per batch


@dataclass
class FileReport:
    """What one file (or datasets folder) held.

    Example:
        >>> FileReport("a.jsonl").line()
        'a.jsonl: no documents'
    """

    path: str
    formats: Counter[str] = field(default_factory=Counter)
    """Documents per record format."""
    tokens: int = 0
    """Tokens of its documents (EOS and template text included)."""
    trained: int = 0
    """Of those, the tokens with a label (before packing or truncation)."""
    unused_keys: set[str] = field(default_factory=set)
    """Keys (columns) of its records that their format does not read."""
    conversations: int = 0
    """Documents rendered with the chat template."""
    added: Counter[str] = field(default_factory=Counter)
    """Text the chat template added besides its markup -> conversations it was added to."""

    @property
    def documents(self) -> int:
        return sum(self.formats.values())

    def line(self) -> str:
        """One line for the run's report."""
        if not self.documents:
            return f"{self.path}: no documents"
        fmt = ", ".join(f"{f} {n}" if len(self.formats) > 1 else f for f, n in self.formats.items())
        out = (
            f"{self.path}: {fmt}, {self.documents} documents, {self.tokens} tokens, "
            f"{self.trained} trained"
        )
        if self.unused_keys:
            out += f" (keys not used: {', '.join(sorted(self.unused_keys))})"
        for text, n in self.added.most_common(3):
            short = text if len(text) <= 100 else text[:97] + "..."
            out += (
                f"\n  the chat template added {short!r} to {n} of {self.conversations} "
                "conversations"
            )
        return out


@dataclass
class PackedDataset:
    """Examples, each {"input_ids": (seq_len,), "labels": (seq_len,)} LongTensors (rows of two
    (n, seq_len) tensors: in memory, or mapped from the cache file), and what the files held
    (`summary()`).

    Example:
        >>> ds = build_dataset(["a.txt"], tok, seq_len=128)  # doctest: +SKIP
        >>> len(ds.train), ds.train[0]["input_ids"].shape    # doctest: +SKIP
        (412, torch.Size([128]))
    """

    train: list[dict[str, torch.Tensor]]
    """Training examples, in corpus order (iterate_batches shuffles them per epoch)."""
    eval: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Held-out examples (eval_fraction of all examples, chosen by the seed)."""
    seq_len: int = 0
    """Tokens per example."""
    num_documents: int = 0
    """Documents (texts, prompt pairs, conversations) read from the files."""
    num_tokens: int = 0
    """Tokens of the documents (EOS and template text included, padding excluded)."""
    num_labelled: int = 0
    """Labels that are not IGNORE_INDEX, over train and eval."""
    num_trained: int = 0
    """Labels the loss uses: num_labelled less each example's first (no token precedes it)."""
    packing: bool = True
    """Documents packed back to back (else one per example, padded)."""
    train_on: str = "assistant"
    """What was labelled: "assistant", "last" or "all"."""
    files: list[FileReport] = field(default_factory=list)
    """Per file: formats, documents, tokens, trained tokens, template text."""
    skipped: list[str] = field(default_factory=list)
    """Files inside the data folders that are not data (README.md, ...)."""
    truncated: int = 0
    """Without packing: documents cut at seq_len."""
    dropped: int = 0
    """Examples left out, with no trained token: documents within seq_len (without packing), or
    packed chunks of context alone (with packing)."""

    def summary(self) -> str:
        """What the run trains on, as printed by `quantmesh finetune`.

        Example:
            >>> print(ds.summary())  # doctest: +SKIP
            data: chat.jsonl: messages, 5 documents, 160 tokens, 45 trained
            data: 5 documents, 160 tokens, 45 trained (assistant turns) -> 5 train / 0 eval examples of 64 (one per document, padded)
        """
        lines = [f"data: {f.line()}" for f in self.files]
        if self.skipped:
            lines.append(f"data: skipped (not data files): {', '.join(self.skipped)}")
        what = {"assistant": "assistant turns", "last": "last assistant turns", "all": "all"}
        trained = what[self.train_on]
        if self.files and all(set(f.formats) <= {"text"} for f in self.files):
            trained = "all: plain text"  # train_on picks among turns: text has none
        layout = "packed" if self.packing else "one per document, padded"
        lines.append(
            f"data: {self.num_documents} documents, {self.num_tokens} tokens, {self.num_trained} "
            f"trained ({trained}) -> {len(self.train)} train / {len(self.eval)} eval "
            f"examples of {self.seq_len} ({layout})"
        )
        if not self.packing and (self.truncated or self.dropped):
            lines.append(
                f"data: {self.truncated} documents longer than {self.seq_len} tokens were cut; "
                f"{self.dropped} documents with no trained token within {self.seq_len} were left "
                "out (raise --seq-len, or pack)"
            )
        elif self.dropped:
            lines.append(
                f"data: {self.dropped} packed examples with no trained token (context alone, such "
                "as the middle of a long prompt) were left out: they would add nothing to the loss"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------- reading
def _documents(
    sources: list[Source], data_format: str, reports: list[FileReport]
) -> Iterator[tuple[FileReport, str, Document]]:
    """(file report, where, Document) of every record, in file order."""
    if data_format != "auto" and data_format not in FORMATS:
        raise DataError(f"data_format={data_format!r}; use auto or one of {', '.join(FORMATS)}")
    for src in sources:
        rep = FileReport(str(src.path) + (f" (split {src.split!r})" if src.split else ""))
        reports.append(rep)
        if src.kind == "text" and data_format not in ("auto", "text"):
            raise DataError(
                f"{src.path}: a plain text file, but --data-format {data_format}; pass "
                f"{data_format} records in .jsonl / .json / .csv / .parquet, or leave --data-format "
                "auto"
            )
        for pos, obj in records(src):
            where = src.where(pos)
            if not isinstance(obj, dict):
                raise DataError(
                    f"{where}: expected a JSON object (a record); got a JSON {type(obj).__name__}"
                )
            keys = {k for k, v in obj.items() if v is not None}
            fmt = detect(keys) if data_format == "auto" else data_format
            if fmt is None or not all(k in keys for k in needs(fmt)):
                raise no_format_error(where, keys, None if data_format == "auto" else fmt)
            rep.formats[fmt] += 1
            rep.unused_keys |= keys - set(used_keys(fmt))
            yield rep, where, to_document(obj, fmt, where)
        if not rep.documents:
            what = "text" if src.kind == "text" else "records"
            raise DataError(
                f"{src.path}: no {what} found (the file is empty); remove it or add data"
            )


def read_documents(
    paths: str | Path | Sequence[str | Path], data_format: str = "auto"
) -> list[Document]:
    """Every document of the files and folders, in order (checked as `build_dataset` reads them).

    Example:
        >>> docs = read_documents("train.jsonl")  # doctest: +SKIP
        >>> docs[0].messages[-1]                  # doctest: +SKIP
        {'role': 'assistant', 'content': 'Blue.'}
    """
    sources, _ = expand([paths] if isinstance(paths, (str, Path)) else paths)
    return [d for _, _, d in _documents(sources, data_format, [])]


def scan_data(
    paths: Sequence[str | Path], data_format: str = "auto", tokenizer: Any = None
) -> list[FileReport]:
    """Read every record once (streamed, nothing kept) and return what each file holds: the
    launcher's check that the data is readable before any worker starts. With a tokenizer, the
    first conversation also checks that it has a chat template.

    Example:
        >>> [r.formats for r in scan_data(["chat.jsonl"])]  # doctest: +SKIP
        [Counter({'messages': 5})]
    """
    sources, _ = expand(paths)
    reports: list[FileReport] = []
    checked = tokenizer is None
    for _, where, doc in _documents(sources, data_format, reports):
        templated = doc.kind == "chat" or (doc.kind == "response" and _has_template(tokenizer))
        if not checked and templated:
            check_chat_tokenizer(tokenizer, where)
            checked = True
    return reports


def _has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# ------------------------------------------------------------------------------------- tokenizing
Encoded = tuple[list[int], list[int]]  # (input ids, labels) of one document


def _tokenize_texts(texts: list[str], tokenizer: Any) -> list[list[int]]:
    """Token ids of each text, no special tokens added; long texts cut into pieces for one batch."""
    pieces, owner = [], []
    for i, text in enumerate(texts):
        for piece in _pieces(text):
            pieces.append(piece)
            owner.append(i)
    ids: list[list[int]] = [[] for _ in texts]
    if pieces:
        for i, piece_ids in zip(owner, _encode(tokenizer, pieces), strict=True):
            ids[i].extend(piece_ids)
    return ids


def _pieces(text: str) -> list[str]:
    if len(text) <= _PIECE_CHARS:
        return [text] if text else []
    out, cur = [], ""
    for part in _CUT.split(text):
        cur += part
        if len(cur) >= _PIECE_CHARS:
            out.append(cur)
            cur = ""
    if cur:
        out.append(cur)
    return out


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    # One batched call: a fast tokenizer encodes a batch on all cores.
    return list(tokenizer(texts, add_special_tokens=False)["input_ids"])


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__} has no eos_token, which ends documents; set "
            "one, e.g. tokenizer.eos_token = '</s>' (a token of its vocabulary)"
        )
    return int(eos)


def _encode_docs(
    items: list[tuple[FileReport, str, Document]], tokenizer: Any, train_on: str
) -> list[Encoded]:
    """(input_ids, labels) of each document, in order; labels are IGNORE_INDEX where not trained.

    Text: the text + EOS. A prompt pair without a template (a completion always): prompt +
    answer + EOS as they are (put any separator you want at the end of the prompt). Conversations
    (a prompt/response pair too, when the tokenizer has a chat template): the chat template's text.
    """
    has_template = _has_template(tokenizer)
    out: list[Encoded | None] = [None] * len(items)
    texts, pairs, chats = [], [], []
    for i, (rep, where, d) in enumerate(items):
        if d.kind == "text":
            texts.append(i)
        elif d.kind == "completion" or (d.kind == "response" and not has_template):
            pairs.append(i)
        else:
            if d.kind == "response":  # a user turn and an assistant turn
                msgs = ({"role": "user", "content": d.prompt}, {"role": "assistant",
                        "content": d.response})  # fmt: skip
                items[i] = (rep, where, Document(messages=msgs))
            chats.append(i)
    if texts:
        eos = _eos_id(tokenizer)
        for i, x in zip(texts, _tokenize_texts([_text(items[i][2]) for i in texts], tokenizer),
                        strict=True):  # fmt: skip
            out[i] = (x + [eos], x + [eos])  # EOS ends every text and is a target
    if pairs:
        eos = _eos_id(tokenizer)
        p_ids = _encode(tokenizer, [items[i][2].prompt or "" for i in pairs])
        a_ids = _encode(tokenizer, [_answer(items[i][2]) for i in pairs])
        for i, p, a in zip(pairs, p_ids, a_ids, strict=True):
            ids = p + a + [eos]  # EOS ends the answer and is a target: the model learns to stop
            out[i] = (ids, list(ids) if train_on == "all" else [IGNORE_INDEX] * len(p) + a + [eos])
    if chats:
        chat_items = [(items[i][1], items[i][2]) for i in chats]
        for i, (x, y, added) in zip(chats, encode_chats(chat_items, tokenizer, train_on),
                                    strict=True):  # fmt: skip
            out[i] = (x, y)
            rep = items[i][0]
            rep.conversations += 1
            for text in dict.fromkeys(added):
                rep.added[text] += 1
    result = []
    for (rep, _, _), enc in zip(items, out, strict=True):
        assert enc is not None  # every document is one of the three kinds
        rep.tokens += len(enc[0])
        rep.trained += sum(1 for v in enc[1] if v != IGNORE_INDEX)
        result.append(enc)
    return result


def _text(d: Document) -> str:
    assert d.text is not None  # a text document
    return d.text


def _answer(d: Document) -> str:
    answer = d.completion if d.completion is not None else d.response
    assert answer is not None  # a prompt pair
    return answer


# ---------------------------------------------------------------------------------------- packing
def build_dataset(
    paths: str | Path | Sequence[str | Path],
    tokenizer: Any,
    seq_len: int,
    *,
    eval_fraction: float = 0.0,
    seed: int = 0,
    data_format: str = "auto",
    train_on: str = "assistant",
    packing: bool = True,
    cache_dir: str | Path | None = None,
) -> PackedDataset:
    """Read, tokenize and pack the files into examples of exactly seq_len tokens.

    `paths`: files and folders (see the module docstring). `data_format`: "auto" (each record's
    keys name its format) or one of formats.FORMATS for every record. `train_on`: "assistant",
    "last" or "all". With `packing` (the default) the documents follow each other in one stream
    (each ends with EOS or the template's end of turn), cut into seq_len chunks; without, each
    document is one example, cut at seq_len and padded. Labels equal input_ids where trained (the
    model shifts them) and are -100 elsewhere and on padding. eval_fraction of the examples,
    chosen by seed, go to `.eval`.

    `cache_dir`: keep the examples in a file there (`train.cache`), keyed by the files (paths,
    sizes, modification times), the tokenizer and these arguments; a later call with the same
    key reads that file instead of the data. Either way the examples are then views of the file,
    memory-mapped: pages of the page cache, not memory of this process. Without it, they are
    tensors in memory. The examples are the same both ways. For many processes of one host, see
    `shared_dataset`.

    Example:
        >>> ds = build_dataset(["plays.txt", "chat.parquet"], tok, 256, eval_fraction=0.05)  # doctest: +SKIP
        >>> ds.train[0]["input_ids"].shape, ds.train[0]["labels"].dtype  # doctest: +SKIP
        (torch.Size([256]), torch.int64)
        >>> ds = build_dataset("chat.jsonl", tok, 256, cache_dir="out/data-cache")  # doctest: +SKIP
    """
    paths = _check_args(paths, seq_len, eval_fraction, data_format, train_on)
    options: dict[str, Any] = dict(seq_len=seq_len, eval_fraction=eval_fraction, seed=seed,
                   data_format=data_format, train_on=train_on, packing=packing)  # fmt: skip
    sources, skipped = expand(paths)
    if cache_dir is None:
        return _with_rows(*_build(sources, skipped, tokenizer, **options))
    return _cached(sources, skipped, tokenizer, options, Path(cache_dir))


def _check_args(
    paths: str | Path | Sequence[str | Path],
    seq_len: int,
    eval_fraction: float,
    data_format: str,
    train_on: str,
) -> list[str | Path]:
    """The paths as a list; a DataError for any argument out of range."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise DataError("build_dataset got no data paths; pass at least one file or folder")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"seq_len must be an int >= 2 (an input and a target), got {seq_len!r}")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}; e.g. 0.05")
    if data_format != "auto" and data_format not in FORMATS:
        raise DataError(f"data_format={data_format!r}; use auto or one of {', '.join(FORMATS)}")
    if train_on not in TRAIN_ON:
        raise DataError(f"train_on={train_on!r}; use one of {', '.join(TRAIN_ON)}")
    return list(paths)


def _build(
    sources: list[Source],
    skipped: list[Path],
    tokenizer: Any,
    *,
    seq_len: int,
    eval_fraction: float,
    seed: int,
    data_format: str,
    train_on: str,
    packing: bool,
) -> tuple[PackedDataset, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read, tokenize, pack: the report (a PackedDataset without examples), input_ids and labels
    ((n, seq_len) int64, in corpus order) and is_eval ((n,) bool)."""
    reports: list[FileReport] = []
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = _eos_id(tokenizer) if pad is None else int(pad)
    stream_ids: list[torch.Tensor] = []  # packing: the token stream, a chunk of documents each
    stream_labels: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []  # no packing: (2, seq_len) per kept document
    num_docs = num_tokens = truncated = dropped = 0
    chunk: list[tuple[FileReport, str, Document]] = []
    docs = _documents(sources, data_format, reports)
    while True:
        chunk = [item for _, item in zip(range(_CHUNK), docs, strict=False)]
        if not chunk:
            break
        encoded = _encode_docs(chunk, tokenizer, train_on)
        num_docs += len(encoded)
        num_tokens += sum(len(x) for x, _ in encoded)
        if packing:  # one tensor per chunk of documents
            stream_ids.append(torch.tensor([t for x, _ in encoded for t in x], dtype=torch.long))
            stream_labels.append(torch.tensor([t for _, y in encoded for t in y], dtype=torch.long))
            continue
        for x, y in encoded:
            if len(x) > seq_len:
                truncated += 1
                x, y = x[:seq_len], y[:seq_len]
            if all(v == IGNORE_INDEX for v in y[1:]):
                dropped += 1  # nothing the loss could use (position 0 has no predecessor)
                continue
            fill = seq_len - len(x)
            rows.append(torch.tensor([x + [pad] * fill, y + [IGNORE_INDEX] * fill]))
    if packing:
        ids = torch.cat(stream_ids) if stream_ids else torch.zeros(0, dtype=torch.long)
        labels = torch.cat(stream_labels) if stream_labels else torch.zeros(0, dtype=torch.long)
        del stream_ids, stream_labels
        chunks_ids, chunks_labels, dropped = _pack(ids, labels, seq_len, pad)
    else:
        both = torch.stack(rows) if rows else torch.zeros(0, 2, seq_len, dtype=torch.long)
        chunks_ids, chunks_labels = both[:, 0], both[:, 1]
    n = chunks_ids.shape[0]
    if n == 0:
        raise DataError(
            f"the data ({num_tokens} tokens from {num_docs} documents) holds no trainable "
            f"tokens at seq_len={seq_len}; add data or raise seq_len"
        )

    n_eval = 0
    if eval_fraction > 0:
        n_eval = max(1, round(eval_fraction * n))
        if n_eval >= n:
            raise DataError(
                f"eval_fraction={eval_fraction} of {n} examples leaves none to train on; "
                f"lower eval_fraction or add data (or lower seq_len={seq_len})"
            )
    gen = torch.Generator().manual_seed(seed)
    is_eval = torch.zeros(n, dtype=torch.bool)
    is_eval[torch.randperm(n, generator=gen)[:n_eval]] = True
    report = PackedDataset(
        train=[],
        seq_len=seq_len,
        num_documents=num_docs,
        num_tokens=num_tokens,
        num_labelled=int((chunks_labels != IGNORE_INDEX).sum()),
        num_trained=int((chunks_labels[:, 1:] != IGNORE_INDEX).sum()),
        packing=packing,
        train_on=train_on,
        files=reports,
        skipped=[str(p) for p in skipped],
        truncated=truncated,
        dropped=dropped,
    )
    return report, chunks_ids, chunks_labels, is_eval


def _with_rows(
    report: PackedDataset, ids: torch.Tensor, labels: torch.Tensor, is_eval: torch.Tensor
) -> PackedDataset:
    """The report with its examples: rows of the two (n, seq_len) tensors, views that share their
    storage (in memory, or the mapped cache file)."""
    examples = [{"input_ids": ids[i], "labels": labels[i]} for i in range(ids.shape[0])]
    flags = is_eval.tolist()
    report.train = [e for e, ev in zip(examples, flags, strict=True) if not ev]
    report.eval = [e for e, ev in zip(examples, flags, strict=True) if ev]
    return report


# ------------------------------------------------------------------------------------------ cache
def _cached(
    sources: list[Source],
    skipped: list[Path],
    tokenizer: Any,
    options: dict[str, Any],
    cache_dir: Path,
    key: str | None = None,
) -> PackedDataset:
    """The examples of the cache entry of these inputs (`key`, if computed already), built and
    written first if there is none."""
    key = key or cache_key(sources, skipped, tokenizer, options)
    ds = _from_cache(cache_dir, key)
    if ds is not None:
        return ds
    report, ids, labels, is_eval = _build(sources, skipped, tokenizer, **options)
    if cache_key(sources, skipped, tokenizer, options) != key:
        raise DataError(
            "the data files changed while they were read (a size or modification time); run "
            "again once nothing writes to them"
        )
    # (without packing, ids and labels are views into one (n, 2, seq_len) tensor: copied apart)
    tensors = {"input_ids": ids.contiguous(), "labels": labels.contiguous(), "is_eval": is_eval}
    cache_save(cache_entry(cache_dir, key), key, tensors, _report_json(report))
    del tensors, ids, labels  # the copy in memory goes: the mapped file takes its place
    ds = _from_cache(cache_dir, key)
    if ds is None:
        raise DataError(f"{cache_entry(cache_dir, key)}: written, then not readable as written")
    return ds


def _from_cache(cache_dir: Path, key: str) -> PackedDataset | None:
    """The dataset of the entry `key`, its tensors mapped from the file; None if there is none."""
    found = cache_load(cache_entry(cache_dir, key), key)
    if found is None:
        return None
    t, report = found
    return _with_rows(_report_from_json(report), t["input_ids"], t["labels"], t["is_eval"])


def _report_json(report: PackedDataset) -> str:
    fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    del fields["train"], fields["eval"]
    fields["files"] = [
        {
            "path": r.path,
            "formats": list(r.formats.items()),  # (format, count) pairs: the order is kept
            "tokens": r.tokens,
            "trained": r.trained,
            "unused_keys": sorted(r.unused_keys),
            "conversations": r.conversations,
            "added": list(r.added.items()),
        }
        for r in report.files
    ]
    return json.dumps(fields)


def _report_from_json(text: str) -> PackedDataset:
    fields = json.loads(text)
    fields["files"] = [
        FileReport(
            path=r["path"],
            formats=Counter(dict(r["formats"])),
            tokens=r["tokens"],
            trained=r["trained"],
            unused_keys=set(r["unused_keys"]),
            conversations=r["conversations"],
            added=Counter(dict(r["added"])),
        )
        for r in fields["files"]
    ]
    return PackedDataset(train=[], **fields)


SHARED_TIMEOUT = 7200.0
"""Seconds `shared_dataset` waits, by default, for the local rank 0s to tokenize."""


def shared_dataset(
    paths: str | Path | Sequence[str | Path],
    tokenizer: Any,
    seq_len: int,
    *,
    cache_dir: str | Path,
    local_rank: int | None = None,
    timeout: float = SHARED_TIMEOUT,
    eval_fraction: float = 0.0,
    seed: int = 0,
    data_format: str = "auto",
    train_on: str = "assistant",
    packing: bool = True,
) -> PackedDataset:
    """`build_dataset(..., cache_dir=cache_dir)`, the work done by one process per host.

    Collective: every rank of the default process group calls it, with the same arguments. The
    local rank 0 of each host builds the cache entry (or finds it) while the other ranks wait;
    then they map the same file: a host tokenizes once and holds the token ids once, in its page
    cache, however many ranks it runs. `cache_dir` must be a folder every rank of a host can read
    (hosts may share it). `local_rank`: this rank's index on its host (default: torchrun's
    LOCAL_RANK, else the global rank). The wait is one gather over a gloo group with `timeout`
    seconds: a local rank 0 that fails (a bad record: its DataError names the file and the line)
    makes every rank raise, and one that dies or overruns the timeout makes the others raise a
    DataError saying so, never hang. Without a process group, or with one rank, this is
    `build_dataset(..., cache_dir=cache_dir)`.

    Example:
        >>> mesh = qm.init_mesh(tp=2)  # doctest: +SKIP
        >>> ds = shared_dataset(["chat.jsonl"], tok, 256, cache_dir="out/data-cache")  # doctest: +SKIP
    """
    import torch.distributed as dist

    paths = _check_args(paths, seq_len, eval_fraction, data_format, train_on)
    options: dict[str, Any] = dict(seq_len=seq_len, eval_fraction=eval_fraction, seed=seed,
                   data_format=data_format, train_on=train_on, packing=packing)  # fmt: skip
    cache_dir = Path(cache_dir)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise DataError(f"timeout={timeout!r}; pass the seconds to wait, e.g. {SHARED_TIMEOUT}")
    if local_rank is not None and (not isinstance(local_rank, int) or local_rank < 0):
        raise DataError(f"local_rank={local_rank!r}; pass this rank's index on its host (>= 0)")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return _cached(*expand(paths), tokenizer, options, cache_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    # the group first: creating it waits for every rank, which all arrive now, not after the work
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    ds = error = None
    key = failed = ""
    try:  # any failure is told to every rank by the gather below, then raised
        sources, skipped = expand(paths)
        key = cache_key(sources, skipped, tokenizer, options)
        if local_rank == 0:
            ds = _cached(sources, skipped, tokenizer, options, cache_dir, key)
    except Exception as e:
        error, failed = e, f"{type(e).__name__}: {e}"
    everyone: list[Any] = [None] * world
    try:
        mine = (rank, socket.gethostname(), local_rank, key, failed)
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as e:
        raise DataError(
            f"rank {rank} waited for the local rank 0 of each host to tokenize the data into "
            f"{cache_dir}; one did not finish within timeout={timeout:g} s, or died (see its log): "
            f"{str(e)[:200]}"
        ) from None
    finally:
        dist.destroy_process_group(group)
    if error is not None:
        raise error
    for r, _, _, _, why in everyone:
        if why:
            raise DataError(f"rank {r} could not build the dataset: {why}")
    writers: dict[str, list[tuple[int, str]]] = {}
    for r, host, lr, k, _ in everyone:
        if lr == 0:
            writers.setdefault(host, []).append((r, k))
    for r, host, _, k, _ in everyone:
        if len(writers.get(host, [])) != 1:
            raise DataError(
                f"host {host!r} has {len(writers.get(host, []))} ranks of local rank 0, which "
                "tokenizes for the host; need one: pass each rank's index on its host as "
                "local_rank (torchrun's LOCAL_RANK)"
            )
        if k != writers[host][0][1]:
            raise DataError(
                f"rank {r} passed other files, tokenizer or options to shared_dataset than rank "
                f"{writers[host][0][0]} (local rank 0 of its host); every rank must pass the same"
            )
    if ds is None:
        ds = _from_cache(cache_dir, key)
    if ds is None:
        raise DataError(
            f"rank {rank}: the local rank 0 of host {socket.gethostname()!r} wrote the examples "
            f"to {cache_dir}, but this rank does not find them there; pass a cache_dir that every "
            "rank of a host reads alike"
        )
    return ds


def _pack(
    x: torch.Tensor, y: torch.Tensor, seq_len: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Cut the stream into (n, seq_len) chunks, and how many full chunks were left out: a chunk is
    kept only if it has a target (position 0's label is never one: no token precedes it); the
    last partial chunk is padded (labels -100)."""
    n_full, rest = divmod(x.numel(), seq_len)
    if rest and bool((y[n_full * seq_len + 1 :] != IGNORE_INDEX).any()):
        fill = seq_len - rest
        x = torch.cat([x, torch.full((fill,), pad, dtype=torch.long)])
        y = torch.cat([y, torch.full((fill,), IGNORE_INDEX, dtype=torch.long)])
        n_full += 1
    n_tok = n_full * seq_len
    xs, ys = x[:n_tok].view(n_full, seq_len), y[:n_tok].view(n_full, seq_len)
    useful = (ys[:, 1:] != IGNORE_INDEX).any(dim=1)
    if bool(useful.all()):
        return xs, ys, 0
    # a chunk of context alone (a long prompt's middle): nothing for the loss, only an empty step
    return xs[useful], ys[useful], int((~useful).sum())


# --------------------------------------------------------------------------------------- batching
def steps_per_epoch(num_examples: int, micro_batch: int, dp_size: int = 1) -> int:
    """Global batches per epoch (the incomplete last batch is dropped).

    Example:
        >>> steps_per_epoch(10, micro_batch=2, dp_size=2)
        2
    """
    return num_examples // (micro_batch * dp_size)


def iterate_batches(
    examples: Sequence[dict[str, torch.Tensor]],
    micro_batch: int,
    *,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
    epoch: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """This dp rank's micro-batches for one epoch: {"input_ids": (B, T), "labels": (B, T)}.

    The shuffle depends only on (seed, epoch). Global batch g is examples
    perm[g*G : (g+1)*G] with G = micro_batch * dp_size, and rank r takes rows
    [r*micro_batch, (r+1)*micro_batch) of it, so dp=2 with micro_batch=4 sees the same global
    batches as dp=1 with micro_batch=8. The incomplete last global batch is dropped.

    Example:
        >>> for batch in iterate_batches(ds.train, 4, dp_rank=1, dp_size=2, seed=0, epoch=3):  # doctest: +SKIP
        ...     batch["input_ids"].shape
        torch.Size([4, 256])
    """
    if micro_batch < 1:
        raise DataError(f"micro_batch must be >= 1, got {micro_batch}")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
    n = len(examples)
    global_batch = micro_batch * dp_size
    if n < global_batch:
        raise DataError(
            f"{n} examples are fewer than one global batch of {global_batch} "
            f"(micro_batch={micro_batch} x dp={dp_size}); lower micro_batch or seq_len, or add data"
        )
    # A generator seeded from (seed, epoch) alone: the order is the same on every rank and layout.
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=gen).tolist()
    for g in range(n // global_batch):
        start = g * global_batch + dp_rank * micro_batch
        rows = [examples[i] for i in perm[start : start + micro_batch]]
        yield {
            "input_ids": torch.stack([r["input_ids"] for r in rows]),  # (B, T)
            "labels": torch.stack([r["labels"] for r in rows]),  # (B, T)
        }
