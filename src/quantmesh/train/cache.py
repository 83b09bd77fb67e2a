"""Packed examples on disk: written once, memory-mapped by every process that trains on them.

An entry is one safetensors file, `CACHE/<key>.safetensors`: `input_ids` and `labels`
((n, seq_len) int64), `is_eval` ((n,) bool) and, in its metadata, the key and the dataset's
report (JSON). The key hashes everything that decides the examples: every data file's path,
size and modification time (every file of a `datasets` folder), the tokenizer (its class, name,
vocabulary and rules, chat template, special tokens), the build options (seq_len, data_format,
train_on, packing, eval_fraction, seed) and the cache's and package's versions; a change to any of
them names another file, so a stale entry is never read. Nothing is ever deleted: remove the
folder to reclaim the space.

The file is written to a hidden sibling and renamed into place: a reader finds no file or a whole
one, and two writers of one key (nodes that share the folder) write the same bytes. `load` maps
the file copy-on-write (MAP_PRIVATE): the token ids are pages of the file, shared by every process
of the host through the page cache, read as batches touch them, never copied into each process's
anonymous memory.

Example:
    >>> key = cache_key(sources, skipped, tokenizer, {"seq_len": 256})   # doctest: +SKIP
    >>> save(entry(Path("cache"), key), key, {"input_ids": ids}, "{}")    # doctest: +SKIP
    >>> tensors, report = load(entry(Path("cache"), key), key)           # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import struct
from pathlib import Path
from typing import Any, cast

import torch

from .readers import Source

__all__ = ["CACHE_VERSION", "cache_key", "entry", "load", "save"]

CACHE_VERSION = 2
"""Raised when what is stored, or how examples are built from the same inputs, changes."""

_DTYPES = {torch.int64: "I64", torch.bool: "BOOL"}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}


def cache_key(
    sources: list[Source], skipped: list[Path], tokenizer: Any, options: dict[str, Any]
) -> str:
    """The hex digest naming the entry of these files, this tokenizer and these options.

    Example:
        >>> cache_key([], [], tok, {"seq_len": 8})  # doctest: +SKIP
        '3f1c...'
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("quantmesh")
    except PackageNotFoundError:  # a source tree that is not installed
        package = "unknown"
    parts = {
        "cache": CACHE_VERSION,
        "package": package,
        "files": [_file_state(s) for s in sources],
        "skipped": [str(p) for p in skipped],
        "tokenizer": _tokenizer_digest(tokenizer),
        "options": options,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _file_state(src: Source) -> list[Any]:
    """What identifies a source's content cheaply: path, size, modification time of each file."""
    head = [str(src.path), str(src.path.resolve()), src.kind, src.split]
    if not src.path.is_dir():
        st = src.path.stat()
        return [*head, st.st_size, st.st_mtime_ns]
    files = []
    for f in sorted(src.path.rglob("*")):
        if f.is_file():
            st = f.stat()
            files.append([f.relative_to(src.path).as_posix(), st.st_size, st.st_mtime_ns])
    return [*head, files]


def _tokenizer_digest(tokenizer: Any) -> str:
    """A digest of all of the tokenizer that tokenizing reads."""
    from .formats import DataError

    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: vocabulary, merges, normalizer, added tokens...
        h.update(backend.to_str().encode())
    elif callable(getattr(tokenizer, "get_vocab", None)):
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        vocab_file = getattr(tokenizer, "vocab_file", None)  # a sentencepiece model's rules
        if isinstance(vocab_file, str) and os.path.isfile(vocab_file):
            h.update(Path(vocab_file).read_bytes())
    else:
        raise DataError(
            f"cache_dir needs a tokenizer whose vocabulary can be read (get_vocab()), to tell its "
            f"examples from another's; {type(tokenizer).__name__} has none: pass cache_dir=None"
        )
    rest = [
        type(tokenizer).__name__,
        getattr(tokenizer, "name_or_path", None),
        getattr(tokenizer, "chat_template", None),
        getattr(tokenizer, "special_tokens_map", None),
        getattr(tokenizer, "eos_token_id", None),
        getattr(tokenizer, "pad_token_id", None),
    ]
    h.update(json.dumps(rest, sort_keys=True, default=str).encode())
    return h.hexdigest()


def entry(cache_dir: Path, key: str) -> Path:
    """The file of `key` in `cache_dir`."""
    return Path(cache_dir) / f"{key[:32]}.safetensors"


def save(path: Path, key: str, tensors: dict[str, torch.Tensor], report: str) -> None:
    """Write `tensors` (int64 or bool, contiguous) and `report` (JSON) as a safetensors file at
    `path`, atomically; the tensors' bytes go to the file as they are, with no copy in between.

    Example:
        >>> save(Path("cache/k.safetensors"), "k", {"input_ids": ids}, "{}")  # doctest: +SKIP
    """
    header: dict[str, Any] = {
        "__metadata__": {"quantmesh.key": key, "quantmesh.report": report},
    }
    offset = 0
    for name, t in tensors.items():
        assert t.dtype in _DTYPES and t.is_contiguous() and t.device.type == "cpu"
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned: int64 views need it
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_writers(path)
    tmp = path.with_name(f".{path.name}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t in tensors.values():
                if t.numel():
                    f.write(t.numpy().data)  # a view of the tensor's memory
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_HOST = "".join(c if c.isalnum() else "_" for c in socket.gethostname())


def _remove_dead_writers(path: Path) -> None:
    """Remove what writers of `path` on this host that no longer run left (a killed one's
    temporary file); another host's are left alone: it may still be writing."""
    for tmp in path.parent.glob(f".{path.name}.tmp-{_HOST}-*"):
        pid = tmp.name[len(f".{path.name}.tmp-{_HOST}-") :].split("-")[0]
        if pid.isdigit() and not _running(int(pid)):
            tmp.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only whether it exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True


def load(path: Path, key: str) -> tuple[dict[str, torch.Tensor], str] | None:
    """The tensors (memory-mapped, copy-on-write) and the report of the entry at `path`; None when
    there is none, it is unreadable, or it holds another key.

    Example:
        >>> tensors, report = load(Path("cache/k.safetensors"), "k")  # doctest: +SKIP
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    meta = header.pop("__metadata__", {})
    if meta.get("quantmesh.key") != key:
        return None
    storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(str(path), False, size))
    data = torch.empty(0, dtype=torch.uint8).set_(storage)  # the file's bytes, mapped
    tensors = {}
    for name, info in header.items():
        start, end = (8 + n + o for o in info["data_offsets"])
        if info.get("dtype") not in _FROM_NAME or end > size:
            return None
        dtype = _FROM_NAME[info["dtype"]]
        tensors[name] = data[start:end].view(dtype).view(info["shape"])
    return tensors, meta["quantmesh.report"]
