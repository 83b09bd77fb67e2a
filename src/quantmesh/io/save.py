"""Saving: the shared machinery every save uses (atomic, rank-0 writes, streamed shards).

Every save is collective and follows one pattern (`collective_save`):

    1. validate on every rank (same inputs, same verdict), agree, before any collective;
    2. global rank 0 opens `atomic_dir(path)`; all ranks agree it worked;
    3. the ranks of the first data-parallel replica gather tp shards one module at a time; rank 0
       writes each as it arrives (write errors are kept, not raised, so that rank 0 keeps joining
       the gathers and no rank is left waiting);
    4. rank 0 swaps the folder in (or drops it on any error); all ranks agree, which is also the
       barrier: every rank returns after the files are in place, or every rank raises.

A process killed mid-save leaves the previous save at `path` intact (atomic.py). The savers:
adapter.py (adapters), resume.py (training state), export.py (merged model).

Example:
    >>> collective_save("out/x", lambda w: w.json("a.json", {}), "save_x")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..parallel.fsdp import is_sharded, whole
from ..parallel.state import parallel_state
from ..tp.gather import gather_param, tp_sharded
from ..tp.layers import ShardedModule
from .atomic import atomic_dir
from .load import _rank, all_ranks_ok

__all__ = [
    "gathers_here",
    "collective_save",
    "agreed",
    "ShardWriter",
    "full_tensor",
    "in_first_replica",
    "parse_size",
]


# ---- the collective save pattern ----------------------------------------------------------------
def agreed(fn: Callable[[], Any], what: str) -> Any:
    """Run `fn` on every rank; if it raises on any rank, raise on every rank (collective).

    Example:
        >>> layout = agreed(lambda: check(model), "save_state")  # doctest: +SKIP
    """
    err, out = None, None
    try:
        out = fn()
    except Exception as e:
        err = e
    all_ranks_ok(err, what)
    return out


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file (one function, so that a test can stop a process in the middle)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _owned(t: torch.Tensor) -> torch.Tensor:
    # safetensors refuses tensors that share storage; a view of a bigger tensor gets its own copy
    t = t.detach().to("cpu").contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def parse_size(size: int | str) -> int:
    """Bytes of "2GB", "500MB", "64KiB" or an int.

    Example:
        >>> parse_size("2GB"), parse_size("1MiB")
        (2000000000, 1048576)
    """
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise ValueError(f"size {size!r} is not understood; use an int of bytes or '2GB'")
        base = 1024 if m[3] else 1000
        value = int(float(m[1]) * base ** " KMGT".index(m[2].upper() or " "))
    if value <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return value


class ShardWriter:
    """Tensors streamed into safetensors files of at most `max_bytes` each (one tensor may exceed
    it alone), plus an HF index when there are several: `{stem}.safetensors` or
    `{stem}-00001-of-0000N.safetensors` + `{stem}.safetensors.index.json`.

    Example:
        >>> w = ShardWriter(folder, "model", 2 << 30)  # doctest: +SKIP
        >>> w.add("lm_head.weight", t); w.close()      # doctest: +SKIP
    """

    def __init__(self, folder: Path, stem: str, max_bytes: int):
        self.folder, self.stem, self.max_bytes = Path(folder), stem, max_bytes
        self._buf: dict[str, torch.Tensor] = {}
        self._size = 0
        self._files: list[tuple[str, list[str]]] = []  # (temporary name, keys)
        self.total = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self._buf or any(key in ks for _, ks in self._files):
            raise AssertionError(f"{key} written twice")
        t = _owned(tensor)
        if self._buf and self._size + t.nbytes > self.max_bytes:
            self._flush()
        self._buf[key] = t
        self._size += t.nbytes
        self.total += t.nbytes

    def _flush(self) -> None:
        name = f"{self.stem}-part{len(self._files) + 1:05d}.safetensors"
        _save_file(self._buf, self.folder / name)
        self._files.append((name, list(self._buf)))
        self._buf, self._size = {}, 0

    def close(self) -> list[str]:
        """Write what is left, give the files their final names; returns them."""
        if self._buf or not self._files:
            self._flush()
        n = len(self._files)
        if n == 1:
            final = [f"{self.stem}.safetensors"]
        else:
            final = [f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, keys), name in zip(self._files, final, strict=True):
            os.rename(self.folder / tmp, self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / f"{self.stem}.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
        return final


class _Rank0Writer:
    """Rank 0's handle on the temporary folder; a failed write is kept and raised at the end."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.error: BaseException | None = None

    def __bool__(self) -> bool:
        return self.folder is not None

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.folder is None or self.error is not None:
            return None
        try:
            return fn(*args)
        except Exception as e:  # keep joining the collectives; raised after them
            self.error = e
            return None

    def json(self, name: str, obj: Any) -> None:
        text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
        folder = self.folder
        if folder is not None:  # run() does nothing without a folder either
            self.run(lambda: (folder / name).write_text(text))


def collective_save(
    path: str | os.PathLike, produce: Callable[[_Rank0Writer], None], what: str
) -> None:
    """Run `produce(writer)` on every rank; rank 0's writes land atomically at `path`.

    `writer` is falsy on other ranks. Collective; see the module docstring for the protocol.

    Example:
        >>> collective_save("out/x", lambda w: w.json("a.json", {}), "save_x")  # doctest: +SKIP
    """
    stack = ExitStack()
    writer = _Rank0Writer(None)

    def enter() -> None:
        if _rank() == 0:
            writer.folder = stack.enter_context(atomic_dir(path))

    agreed(enter, what)
    err = None
    try:
        produce(writer)
        if writer.error is not None:
            raise writer.error
    except Exception as e:
        err = e
    if _rank() == 0:
        try:
            if err is None:
                stack.close()  # swap the new folder in
            else:
                stack.__exit__(type(err), err, err.__traceback__)  # drop it; keep the old save
        except Exception as e:
            err = err or e
    all_ranks_ok(err, what)


def in_first_replica(model: nn.Module) -> bool:
    """True on the ranks of data-parallel replica 0 (the ones that gather and write).

    Example:
        >>> in_first_replica(model)  # doctest: +SKIP  (dp_rank 0 of a dp=2 mesh)
        True
    """
    st = parallel_state(model, required=False)
    return st is None or st.mesh.dp_rank == 0


def gathers_here(model: nn.Module) -> bool:
    """True on the ranks that take part in gathering tensors to save: replica 0's, or every rank
    when FSDP splits each tensor over dp too.

    Example:
        >>> gathers_here(model)  # doctest: +SKIP
        True
    """
    return in_first_replica(model) or is_sharded(model)


def full_tensor(m: ShardedModule, name: str, local: torch.Tensor | None = None) -> torch.Tensor:
    """The whole tensor `name` of `m` (all-gathered over tp when split; collective then).

    Example:
        >>> full_tensor(q_proj, "lora_B.weight").shape  # doctest: +SKIP
        torch.Size([576, 16])
    """
    t = whole(local if local is not None else m.get_parameter(name)).detach()  # over dp (FSDP)
    spec = tp_sharded(m).get(name)
    return t if spec is None else gather_param(t, spec[0], spec[1], m.group)
