"""The examples cache (`build_dataset(cache_dir=)`, `shared_dataset`) and the streamed JSON array.

The cached dataset must be the uncached one exactly, reused only while nothing that decides it
changed, and mapped from its file rather than copied into each process; on two gloo ranks only the
local rank 0 reads and tokenizes, and its failure reaches the other rank as an error, not a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from quantmesh.train import cache as cache_module
from quantmesh.train import data, readers
from quantmesh.train.data import DataError, build_dataset, iterate_batches, shared_dataset
from quantmesh.train.readers import Source, records

from .test_data import TEMPLATE, make_tokenizer, write_jsonl
from .test_data_formats import DEFAULT_SYSTEM, MULTI, ONE_TURN


def _files(folder: Path) -> list[Path]:
    """A text file and chat records: packed examples with masked labels and an eval split."""
    (folder / "a.txt").write_text(" ".join(["a b c d e f g h hello world"] * 12))
    chats = [ONE_TURN["messages"], MULTI, ONE_TURN["alpaca"], ONE_TURN["sharegpt"]] * 3
    return [folder / "a.txt", write_jsonl(folder / "chat.jsonl", chats)]


def _rows(examples) -> list[tuple[list[int], list[int]]]:
    return [(e["input_ids"].tolist(), e["labels"].tolist()) for e in examples]


def _same(got, want) -> None:
    assert _rows(got.train) == _rows(want.train) and _rows(got.eval) == _rows(want.eval)
    assert got.summary() == want.summary()
    for name in ("seq_len", "num_documents", "num_tokens", "num_labelled", "num_trained",
                 "packing", "train_on", "files", "skipped", "truncated", "dropped"):  # fmt: skip
        assert getattr(got, name) == getattr(want, name), name
    for e in got.train + got.eval:
        assert e["input_ids"].dtype == e["labels"].dtype == torch.long


def _count_builds(monkeypatch) -> list[int]:
    calls = [0]
    build = data._build

    def counted(*args, **kwargs):
        calls[0] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(data, "_build", counted)
    return calls


def _mapped_from(t: torch.Tensor, path: Path) -> bool:
    """Whether t's memory lies in a mapping of the file `path` (Linux: /proc/self/maps)."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= ptr < hi:
                return len(fields) == 6 and Path(fields[5].strip()) == path
    return False


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")


@pytest.mark.parametrize("packing", [True, False])
def test_the_cached_dataset_is_the_uncached_one(tmp_path, packing):
    tok = make_tokenizer(TEMPLATE)
    files = _files(tmp_path)
    kw = dict(eval_fraction=0.25, seed=5, packing=packing)
    want = build_dataset(files, tok, 12, **kw)
    assert want.eval and want.num_labelled < want.num_tokens  # a split and masked labels to keep
    first = build_dataset(files, tok, 12, cache_dir=tmp_path / "cache", **kw)  # writes
    again = build_dataset(files, tok, 12, cache_dir=tmp_path / "cache", **kw)  # reads
    for got in (first, again):
        _same(got, want)
        for epoch in (0, 1):  # the same batches, epoch after epoch
            for a, b in zip(iterate_batches(got.train, 2, seed=3, epoch=epoch),
                            iterate_batches(want.train, 2, seed=3, epoch=epoch), strict=True):  # fmt: skip
                assert torch.equal(a["input_ids"], b["input_ids"])
                assert torch.equal(a["labels"], b["labels"])


def test_the_cache_is_reused_until_a_file_or_an_argument_changes(tmp_path, monkeypatch):
    tok = make_tokenizer(TEMPLATE)
    files = _files(tmp_path)
    cache = tmp_path / "cache"
    builds = _count_builds(monkeypatch)

    def build(seq_len=12, tokenizer=tok, **kw):
        return build_dataset(files, tokenizer, seq_len, cache_dir=cache, **kw)

    ref = build()
    assert builds == [1]
    build()
    assert builds == [1]  # read from the cache, not from the files
    # every argument that decides the examples names another entry
    for changed in ({"seq_len": 16}, {"eval_fraction": 0.1}, {"seed": 1, "eval_fraction": 0.2},
                    {"train_on": "all"}, {"packing": False},
                    {"tokenizer": make_tokenizer(DEFAULT_SYSTEM)},  # another chat template
                    {"tokenizer": make_tokenizer(TEMPLATE, pad=True)}):  # another pad token  # fmt: skip
        before = builds[0]
        build(**changed)
        assert builds[0] == before + 1, changed
        build(**changed)
        assert builds[0] == before + 1, changed
    # a data file rewritten (other size and time), and one touched (same bytes, later time)
    n = builds[0]
    files[0].write_text(files[0].read_text() + " good")
    assert build().num_tokens == ref.num_tokens + 1 and builds[0] == n + 1
    st = files[1].stat()
    os.utime(files[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    build()
    assert builds[0] == n + 2
    build()
    assert builds[0] == n + 2
    assert len(list(cache.glob("*.safetensors"))) == builds[0]
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary left
    # what a killed writer of this host left is removed by the next writer; another host's stays
    (entry,) = [p for p in cache.glob("*.safetensors") if p.stat().st_mtime_ns == max(
        q.stat().st_mtime_ns for q in cache.glob("*.safetensors"))]  # fmt: skip
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dead = cache / f".{entry.name}.tmp-{cache_module._HOST}-{ended.pid}-0badf00d"
    other = cache / f".{entry.name}.tmp-elsewhere-{ended.pid}-0badf00d"
    dead.write_bytes(b"partial")
    other.write_bytes(b"partial")
    entry.unlink()
    build()
    assert entry.is_file() and not dead.exists() and other.exists()


@needs_proc
def test_cached_examples_are_pages_of_the_file_not_copies(tmp_path):
    tok = make_tokenizer(TEMPLATE)
    files = _files(tmp_path)
    cache = tmp_path / "cache"
    plain = build_dataset(files, tok, 12, eval_fraction=0.25)
    assert not _mapped_from(plain.train[0]["input_ids"], tmp_path)  # the check can fail
    for _ in range(2):  # the writer's examples, then a reader's
        ds = build_dataset(files, tok, 12, eval_fraction=0.25, cache_dir=cache)
        (entry,) = cache.glob("*.safetensors")
        for e in ds.train + ds.eval:
            assert _mapped_from(e["input_ids"], entry) and _mapped_from(e["labels"], entry)
    # the mapping is copy-on-write: a change to an example stays in this process
    before = entry.read_bytes()
    ds.train[0]["labels"][0] = 7
    assert entry.read_bytes() == before


def test_the_cache_file_is_safetensors(tmp_path):
    from safetensors import safe_open

    tok = make_tokenizer(TEMPLATE)
    ds = build_dataset(_files(tmp_path), tok, 12, eval_fraction=0.25, cache_dir=tmp_path / "c")
    (entry,) = (tmp_path / "c").glob("*.safetensors")
    with safe_open(str(entry), framework="pt") as f:
        ids, is_eval = f.get_tensor("input_ids"), f.get_tensor("is_eval")
        report = json.loads(f.metadata()["quantmesh.report"])
    assert ids.shape == (len(ds.train) + len(ds.eval), 12) and int(is_eval.sum()) == len(ds.eval)
    assert torch.equal(ids[~is_eval], torch.stack([e["input_ids"] for e in ds.train]))
    assert report["num_tokens"] == ds.num_tokens


def test_a_tokenizer_without_a_vocabulary_is_not_cached(tmp_path):
    class Bare:  # encodes, but nothing tells two of them apart
        eos_token_id = 1

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[2] * len(t.split()) for t in texts]}

    (tmp_path / "a.txt").write_text("a b c d")
    assert len(build_dataset(tmp_path / "a.txt", Bare(), 2).train) == 2
    with pytest.raises(DataError, match="Bare has none: pass cache_dir=None"):
        build_dataset(tmp_path / "a.txt", Bare(), 2, cache_dir=tmp_path / "c")


# ---------------------------------------------------------------------------------- two ranks
def _shared_ranks(rank: int, folder: str) -> dict:
    """Rank 0 and 1 of one host: who reads, what they hold, how a failure of rank 0 reaches 1."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    root = Path(folder)
    tok = make_tokenizer(TEMPLATE)
    files = [root / "a.txt", root / "chat.jsonl"]
    out: dict = {}
    builds = [0]
    build = data._build

    def counted(*args, **kwargs):
        builds[0] += 1
        if out.get("slow"):
            time.sleep(3)  # past the waiting rank's timeout of 1 s
        return build(*args, **kwargs)

    data._build = counted
    kw = dict(eval_fraction=0.25, seed=5)
    ds = shared_dataset(files, tok, 12, cache_dir=root / "cache", **kw)
    (entry,) = (root / "cache").glob("*.safetensors")
    out["rows"] = (_rows(ds.train), _rows(ds.eval), ds.summary())
    out["mapped"] = all(_mapped_from(e["input_ids"], entry) for e in ds.train + ds.eval)
    out["builds"] = builds[0]
    shared_dataset(files, tok, 12, cache_dir=root / "cache", **kw)
    out["builds_again"] = builds[0]
    try:  # line 2 of bad.jsonl is no record
        shared_dataset([root / "bad.jsonl"], tok, 12, cache_dir=root / "cache", timeout=60)
    except DataError as e:
        out["bad"] = str(e)
    out["slow"] = rank == 0
    try:
        shared_dataset(files, tok, 12, cache_dir=root / "cache2", timeout=1.0, **kw)
    except DataError as e:
        out["late"] = str(e)
    return out


def test_two_ranks_one_reader_and_its_failure_reaches_the_other(tmp_path):
    from quantmesh.testing import run_ranks

    tok = make_tokenizer(TEMPLATE)
    files = _files(tmp_path)
    write_jsonl(tmp_path / "bad.jsonl", [{"text": "a b"}, {"foo": 1}])
    want = build_dataset(files, tok, 12, eval_fraction=0.25, seed=5)
    r0, r1 = run_ranks(_shared_ranks, 2, str(tmp_path), timeout=300)
    for r in (r0, r1):
        assert r["rows"] == (_rows(want.train), _rows(want.eval), want.summary())
        assert r["mapped"]  # rank 1 holds pages of the file rank 0 wrote
    assert (r0["builds"], r1["builds"]) == (1, 0)  # only local rank 0 read and tokenized
    assert (r0["builds_again"], r1["builds_again"]) == (1, 0)  # then nobody: the cache
    # rank 0's own error names the file and the line; rank 1 gets it, not a hang
    assert r0["bad"].startswith(f"{tmp_path / 'bad.jsonl'} line 2: no known format")
    assert r1["bad"] == f"rank 0 could not build the dataset: DataError: {r0['bad']}"
    assert "did not finish within timeout=1 s, or died" in r1["late"]
    assert "late" in r0  # the slow rank 0 learns that rank 1 gave up, too


def test_without_a_process_group_shared_dataset_is_the_cached_build(tmp_path, monkeypatch):
    tok = make_tokenizer(TEMPLATE)
    files = _files(tmp_path)
    builds = _count_builds(monkeypatch)
    got = shared_dataset(files, tok, 12, cache_dir=tmp_path / "c", eval_fraction=0.25)
    _same(got, build_dataset(files, tok, 12, eval_fraction=0.25, cache_dir=tmp_path / "c"))
    assert builds == [1]
    with pytest.raises(DataError, match="eval_fraction must be in"):
        shared_dataset(files, tok, 12, cache_dir=tmp_path / "c", eval_fraction=1.5)
    with pytest.raises(DataError, match="timeout=0; pass the seconds to wait"):
        shared_dataset(files, tok, 12, cache_dir=tmp_path / "c", timeout=0)


# ------------------------------------------------------------------------------- JSON arrays
RECORDS = [{"text": f"hello {'é' * (i % 7)} world {i}", "n": i * 1e3, "x": [None, True]}
           for i in range(200)]  # fmt: skip


@pytest.mark.parametrize("read", [1, 3, 64, 1 << 20])
def test_a_json_array_reads_like_json_loads_in_pieces_of_any_size(tmp_path, monkeypatch, read):
    monkeypatch.setattr(readers, "_JSON_READ", read)
    for indent in (None, 2):
        f = tmp_path / "a.json"
        f.write_bytes(b"\xef\xbb\xbf" + json.dumps(RECORDS, indent=indent).encode())
        assert list(records(Source(f, "json"))) == list(enumerate(RECORDS))
    f.write_text("[ 1, 23 ,456]\n")  # numbers cut by a piece go on in the next
    assert [r for _, r in records(Source(f, "json"))] == [1, 23, 456]
    f.write_text(" [\n ] ")
    assert list(records(Source(f, "json"))) == []


def test_a_json_array_is_streamed_record_by_record(tmp_path, monkeypatch):
    # Invalid JSON far past the first records: a reader that parses the whole text first fails
    # before giving any record; a streaming one gives the records before the bad one, then names it.
    monkeypatch.setattr(readers, "_JSON_READ", 256)
    f = tmp_path / "big.json"
    body = ",\n".join(json.dumps(r) for r in RECORDS)
    f.write_text(f'[{body},\n{{"text": oops}}]')
    it = records(Source(f, "json"))
    assert next(it) == (0, RECORDS[0])
    assert [next(it)[1] for _ in RECORDS[1:]] == RECORDS[1:]
    with pytest.raises(DataError) as e:
        next(it)
    assert str(e.value) == (
        f"{f} row {len(RECORDS)}: expected a JSON array of records; got invalid JSON "
        f"(Expecting value: line {len(RECORDS) + 1} column 10)"
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[{"text": "a"},\n {"text": "b"}\n {"text": "c"}]',
         "row 1: expected a JSON array of records; got invalid JSON (expected ',' or ']' after "
         "the record: line 3 column 2)"),
        ('[{"text": "a"},]', "row 1: expected a JSON array of records; got invalid JSON "
         "(expected a record after ',': line 1 column 16)"),
        ('[{"text": "a"}] [', "row 1: expected a JSON array of records; got invalid JSON "
         "(extra data after the array: line 1 column 17)"),
        ('[{"text": "a"}', "row 0: expected a JSON array of records; got invalid JSON "
         "(expected ',' or ']' after the record: line 1 column 15)"),
    ],
)  # fmt: skip
def test_a_broken_json_array_names_the_row_line_and_column(tmp_path, monkeypatch, text, expected):
    f = tmp_path / "a.json"
    f.write_text(text)
    for read in (1, 1 << 20):
        monkeypatch.setattr(readers, "_JSON_READ", read)
        with pytest.raises(DataError) as e:
            list(records(Source(f, "json")))
        assert str(e.value) == f"{f} {expected}"
    f.write_bytes(b'[{"text": "a"},\n{"text": "\xe6"}]')
    with pytest.raises(DataError, match=r"a.json line 2: expected UTF-8 text, found byte 0xe6 at "
                       r"offset 26 that is not valid UTF-8"):  # fmt: skip
        list(records(Source(f, "json")))
