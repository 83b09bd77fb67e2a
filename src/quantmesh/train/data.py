"""Training data: read text / instruction files, tokenize, pack into fixed-length examples, batch.

Pure data: no process groups here. Every rank builds the same examples from the same files (the
pipeline is deterministic), then `iterate_batches` hands each dp rank its contiguous share of one
global batch, so the global batches do not depend on how many dp ranks there are.

File formats (chosen by extension, else by content):
  - plain text (`.txt`, `.md`, ...): the whole file is one document;
  - JSONL with a "text" field per line: one document per line;
  - instruction JSONL with "prompt" and "response" fields per line: the loss is on the response only.

Example:
    >>> ds = build_dataset(["plays.txt"], tokenizer, seq_len=256, eval_fraction=0.05)  # doctest: +SKIP
    >>> for batch in iterate_batches(ds.train, 4, dp_rank=0, dp_size=2, seed=0, epoch=0):  # doctest: +SKIP
    ...     loss = model(**batch).loss
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from ..errors import QuantmeshError

__all__ = [
    "IGNORE_INDEX",
    "DataError",
    "Document",
    "PackedDataset",
    "build_dataset",
    "iterate_batches",
    "read_documents",
    "steps_per_epoch",
]

IGNORE_INDEX = -100  # the label transformers' (and torch's) cross-entropy skips

_JSONL_EXTS = {".jsonl", ".ndjson", ".json"}
_TEXT_EXTS = {".txt", ".text", ".md", ".rst"}
# A large plain text is cut before each blank-line run that follows a non-space character, so the
# pieces can be tokenized as one (multi-threaded) batch. For byte-level BPE tokenizers (GPT-2 style
# pre-tokenizer regex: SmolLM2, Llama 3, Qwen...) no pre-token spans such a cut, so the tokens are
# identical to tokenizing the whole file in one call.
_CUT = re.compile(r"(?<!\s)(?=\n\n)")
_PIECE_CHARS = 8192  # pieces are merged back up to about this many characters


class DataError(QuantmeshError, ValueError):
    """A data file that cannot be read as one of the supported formats; the message names the file,
    the line and what was expected."""


@dataclass(frozen=True, kw_only=True)
class Document:
    """One unit of training data read from a file.

    Example:
        >>> Document(text="To be, or not to be").is_instruction
        False
    """

    text: str | None = None
    """Plain text, trained on every token (None for an instruction example)."""
    prompt: str | None = None
    """Instruction prompt: part of the input, never a target."""
    response: str | None = None
    """Instruction response: the only part with labels."""

    def __post_init__(self) -> None:
        if (self.text is None) == (self.prompt is None) or (self.prompt is None) != (
            self.response is None
        ):
            raise ValueError(
                "a Document holds either text=... or prompt=... and response=...; got "
                f"text={self.text!r:.30}, prompt={self.prompt!r:.30}, response={self.response!r:.30}"
            )

    @property
    def is_instruction(self) -> bool:
        return self.prompt is not None


@dataclass
class PackedDataset:
    """Packed examples, each {"input_ids": (seq_len,), "labels": (seq_len,)} LongTensors.

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
    """Documents (texts or instruction examples) read from the files."""
    num_tokens: int = 0
    """Real tokens packed (EOS separators included, end padding excluded)."""
    num_labelled: int = 0
    """Labels that are not IGNORE_INDEX, over train and eval."""


# ---------------------------------------------------------------------------------------- reading
def read_documents(path: str | Path) -> list[Document]:
    """Read one data file: plain text, JSONL with "text", or JSONL with "prompt" and "response".

    The format comes from the extension (.txt/.md: text; .jsonl/.ndjson/.json: JSONL), else from
    the content (a first line that is a JSON object means JSONL).

    Example:
        >>> docs = read_documents("train.jsonl")  # doctest: +SKIP
        >>> docs[0].prompt, docs[0].response      # doctest: +SKIP
        ('Name a colour.', 'Blue.')
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist; check the path")
    if path.is_dir():
        raise IsADirectoryError(f"{str(path)!r} is a directory; pass the data files inside it")
    text = _decode(path, path.read_bytes())
    if _is_jsonl(path, text):
        docs = _parse_jsonl(path, text)
    else:
        docs = [Document(text=text)] if text.strip() else []
    if not docs:
        raise DataError(f"{path}: no text found (the file is empty); remove it or add data")
    return docs


def _decode(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig").replace("\r\n", "\n")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path} line {line}: expected UTF-8 text, found byte 0x{raw[e.start]:02x} at offset "
            f"{e.start} that is not valid UTF-8; re-save the file as UTF-8"
        ) from None


def _is_jsonl(path: Path, text: str) -> bool:
    ext = path.suffix.lower()
    if ext in _JSONL_EXTS:
        return True
    if ext in _TEXT_EXTS:
        return False
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:
        return False


_EXPECTED = "expected a JSON object with a 'text' field, or 'prompt' and 'response'"


def _parse_jsonl(path: Path, text: str) -> list[Document]:
    docs = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline, spacing) carry nothing
        where = f"{path} line {lineno}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            snippet = line if len(line) <= 60 else line[:57] + "..."
            raise DataError(f"{where}: {_EXPECTED}; got invalid JSON ({e}): {snippet!r}") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: {_EXPECTED}; got a JSON {type(obj).__name__}")
        if "prompt" in obj or "response" in obj:
            if not ("prompt" in obj and "response" in obj):
                raise DataError(
                    f"{where}: {_EXPECTED}; got keys {sorted(obj)} (a 'prompt' needs a 'response' "
                    "and the reverse)"
                )
            docs.append(
                Document(
                    prompt=_field(obj, "prompt", where), response=_field(obj, "response", where)
                )
            )
        elif "text" in obj:
            docs.append(Document(text=_field(obj, "text", where)))
        else:
            raise DataError(f"{where}: {_EXPECTED}; got keys {sorted(obj)}")
    return docs


def _field(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {key!r} must be a string, got {type(value).__name__} {value!r:.40}"
        )
    return value


# ------------------------------------------------------------------------------------- tokenizing
def _tokenize_texts(texts: list[str], tokenizer: Any) -> list[list[int]]:
    """Token ids of each text, no special tokens added; long texts cut into pieces for one batch."""
    pieces, owner = [], []
    for i, text in enumerate(texts):
        for piece in _pieces(text):
            pieces.append(piece)
            owner.append(i)
    ids: list[list[int]] = [[] for _ in texts]
    if pieces:
        for i, piece_ids in zip(owner, _encode(tokenizer, pieces)):
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
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _encode_instructions(docs: list[Document], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each instruction example; labels are IGNORE_INDEX on the prompt."""
    if getattr(tokenizer, "chat_template", None):
        # The prompt as a user turn (+ the assistant header), the full text with the assistant turn.
        # Both rendered as strings in a batch, then tokenized in a batch: per-example
        # apply_chat_template(tokenize=True) is an order of magnitude slower on big files.
        users = [[{"role": "user", "content": d.prompt}] for d in docs]
        fulls = [u + [{"role": "assistant", "content": d.response}] for u, d in zip(users, docs)]
        p_text = tokenizer.apply_chat_template(users, tokenize=False, add_generation_prompt=True)
        f_text = tokenizer.apply_chat_template(fulls, tokenize=False)
        p_ids, f_ids = _encode(tokenizer, list(p_text)), _encode(tokenizer, list(f_text))
        out = []
        for p, f in zip(p_ids, f_ids):
            # The rendered prompt is a prefix of the rendered conversation for ordinary templates;
            # where a template renders them differently, train from the first differing token.
            k = _common_prefix(p, f)
            out.append((f, [IGNORE_INDEX] * k + f[k:]))
        return out
    eos = _eos_id(tokenizer)
    # instruction documents: prompt and response are set (the parser checked them)
    p_ids = _encode(tokenizer, cast(list[str], [d.prompt for d in docs]))
    r_ids = _encode(tokenizer, cast(list[str], [d.response for d in docs]))
    # No template: prompt and response are concatenated as they are (put any separator you want at
    # the end of the prompt); EOS ends the response and is a target, so the model learns to stop.
    return [(p + r + [eos], [IGNORE_INDEX] * len(p) + r + [eos]) for p, r in zip(p_ids, r_ids)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__} has no eos_token, which separates packed "
            "documents; set one, e.g. tokenizer.eos_token = '</s>' (a token of its vocabulary)"
        )
    return int(eos)


# ---------------------------------------------------------------------------------------- packing
def build_dataset(
    paths: str | Path | Sequence[str | Path],
    tokenizer: Any,
    seq_len: int,
    *,
    eval_fraction: float = 0.0,
    seed: int = 0,
) -> PackedDataset:
    """Tokenize the files and pack them into examples of exactly seq_len tokens.

    Documents are joined with EOS (texts) or follow each other (instruction examples, which end
    with EOS or the chat template's end of turn) into one stream, cut into seq_len chunks. Labels
    equal input_ids where trained (the model shifts them) and are -100 on prompts and on the end
    padding of the last chunk. eval_fraction of the chunks, chosen by seed, go to `.eval`.

    Example:
        >>> ds = build_dataset(["plays.txt", "qa.jsonl"], tok, 256, eval_fraction=0.05)  # doctest: +SKIP
        >>> ds.train[0]["input_ids"].shape, ds.train[0]["labels"].dtype  # doctest: +SKIP
        (torch.Size([256]), torch.int64)
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise DataError("build_dataset got no data files; pass at least one .txt or .jsonl path")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"seq_len must be an int >= 2 (an input and a target), got {seq_len!r}")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}; e.g. 0.05")

    docs = [d for p in paths for d in read_documents(p)]
    ids, labels = _token_stream(docs, tokenizer)
    num_tokens = len(ids)
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = _eos_id(tokenizer) if pad is None else int(pad)
    chunks_ids, chunks_labels = _pack(ids, labels, seq_len, pad)
    n = chunks_ids.shape[0]
    if n == 0:
        raise DataError(
            f"the data ({num_tokens} tokens from {len(docs)} documents) holds no trainable "
            f"tokens at seq_len={seq_len}; add data or lower seq_len"
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
    # Rows of the two (n, seq_len) tensors: views, so examples share one storage.
    examples = [{"input_ids": chunks_ids[i], "labels": chunks_labels[i]} for i in range(n)]
    return PackedDataset(
        train=[e for e, ev in zip(examples, is_eval.tolist()) if not ev],
        eval=[e for e, ev in zip(examples, is_eval.tolist()) if ev],
        seq_len=seq_len,
        num_documents=len(docs),
        num_tokens=num_tokens,
        num_labelled=int((chunks_labels != IGNORE_INDEX).sum()),
    )


def _token_stream(docs: list[Document], tokenizer: Any) -> tuple[list[int], list[int]]:
    """All documents as one stream of (input id, label), in file order."""
    texts = cast(list[str], [d.text for d in docs if not d.is_instruction])  # text documents
    instr = [d for d in docs if d.is_instruction]
    text_ids = iter(_tokenize_texts(texts, tokenizer)) if texts else iter(())
    instr_pairs = iter(_encode_instructions(instr, tokenizer)) if instr else iter(())
    eos = _eos_id(tokenizer) if texts else None
    ids: list[int] = []
    labels: list[int] = []
    for d in docs:
        if d.is_instruction:
            x, y = next(instr_pairs)
            ids += x
            labels += y
        else:
            assert eos is not None  # set when there are texts
            x = next(text_ids) + [eos]  # EOS ends every text and is a target
            ids += x
            labels += x
    return ids, labels


def _pack(
    ids: list[int], labels: list[int], seq_len: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the stream into (n, seq_len) chunks; the last partial chunk is padded (labels -100)
    and kept only if it still has a target (position 0's label is never a target: no token
    precedes it)."""
    n_full, rest = divmod(len(ids), seq_len)
    x = torch.tensor(ids, dtype=torch.long)
    y = torch.tensor(labels, dtype=torch.long)
    if rest and bool((y[n_full * seq_len + 1 :] != IGNORE_INDEX).any()):
        fill = seq_len - rest
        x = torch.cat([x, torch.full((fill,), pad, dtype=torch.long)])
        y = torch.cat([y, torch.full((fill,), IGNORE_INDEX, dtype=torch.long)])
        n_full += 1
    n_tok = n_full * seq_len
    return x[:n_tok].view(n_full, seq_len), y[:n_tok].view(n_full, seq_len)


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
