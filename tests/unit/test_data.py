"""Data pipeline: readers, packing, instruction loss masking, dp-invariant batching.

A tiny WordLevel tokenizer built offline stands in for a real one: every whitespace-separated word
is one token, so expected ids can be written by hand.
"""

from __future__ import annotations

import json

import pytest
import torch

from quantmesh.train.data import (
    IGNORE_INDEX,
    DataError,
    Document,
    build_dataset,
    iterate_batches,
    read_documents,
    steps_per_epoch,
)

WORDS = ["<unk>", "<eos>", "<pad>", "<|user|>", "<|assistant|>", "\n", "<|system|>"]
WORDS += "a b c d e f g h hello world how are you fine thanks good".split()
ID = {w: i for i, w in enumerate(WORDS)}
TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' <eos> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)


def make_tokenizer(chat_template: str | None = None, pad: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>" if pad else None,
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
    )
    if chat_template:
        tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    return make_tokenizer(TEMPLATE)


def ids(words: str) -> list[int]:
    return [ID[w] for w in words.split()]


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


# -------------------------------------------------------------------------------------- packing
def test_text_packing_lengths_and_content(tmp_path, tok):
    (tmp_path / "a.txt").write_text("a b c d e")
    write_jsonl(tmp_path / "b.jsonl", [{"text": "f g"}, {"text": "h hello world how"}])
    ds = build_dataset([tmp_path / "a.txt", tmp_path / "b.jsonl"], tok, seq_len=4)
    # stream: a b c d e <eos> f g <eos> h hello world how <eos>  (14 tokens) -> 3 chunks + 1 padded
    stream = ids("a b c d e <eos> f g <eos> h hello world how <eos>")
    assert ds.num_documents == 3 and ds.num_tokens == 14
    assert len(ds.train) == 4 and ds.eval == []
    got = torch.cat([e["input_ids"] for e in ds.train]).tolist()
    assert got[:14] == stream
    assert got[14:] == [ID["<eos>"]] * 2  # no pad token: padded with EOS
    for e in ds.train:
        assert e["input_ids"].shape == (4,) and e["input_ids"].dtype == torch.long
        assert e["labels"].dtype == torch.long
    labels = torch.cat([e["labels"] for e in ds.train]).tolist()
    assert labels[:14] == stream  # trained everywhere, the model shifts internally
    assert labels[14:] == [IGNORE_INDEX] * 2  # padding is never a target
    assert ds.num_labelled == 14


def test_pad_token_used_and_untrainable_tail_dropped(tmp_path):
    tok = make_tokenizer(pad=True)
    (tmp_path / "a.txt").write_text("a b c")
    ds = build_dataset(tmp_path / "a.txt", tok, seq_len=3)
    # a b c <eos>: one full chunk; the tail [<eos>] alone has no target (position 0 is none) -> dropped
    assert [e["input_ids"].tolist() for e in ds.train] == [ids("a b c")]
    (tmp_path / "b.txt").write_text("a b c d")
    ds = build_dataset(tmp_path / "b.txt", tok, seq_len=3)
    assert ds.train[1]["input_ids"].tolist() == ids("d <eos> <pad>")
    assert ds.train[1]["labels"].tolist() == ids("d <eos>") + [IGNORE_INDEX]


def test_the_summary_of_plain_text_says_every_token_is_trained(tmp_path, tok):
    """train_on chooses among a conversation's turns; plain text has none, and was summed up as
    "(assistant turns)"."""
    (tmp_path / "a.txt").write_text("a b c d e f g h")
    assert "trained (all: plain text) ->" in build_dataset(tmp_path / "a.txt", tok, 4).summary()
    write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a b", "response": "c d"}])
    mixed = build_dataset([tmp_path / "a.txt", tmp_path / "c.jsonl"], tok, 4).summary()
    assert "trained (assistant turns) ->" in mixed


def test_packed_chunks_of_context_alone_are_left_out_and_said(tmp_path):
    """A packed chunk whose labels are all ignored (the middle of a long prompt) adds nothing to
    the loss: it was kept, and a step on it was an optimizer step on zero gradients (or, with a
    split head, failed in backward). It is left out, and the summary says how many."""
    from quantmesh.train.data import IGNORE_INDEX

    tok = make_tokenizer(TEMPLATE, pad=True)
    prompt = " ".join(["a b c d e f g h"] * 2)  # 16 words of context
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "response": "fine thanks"}])
    ds = build_dataset(tmp_path / "d.jsonl", tok, seq_len=4)
    assert ds.dropped > 0 and ds.train, ds
    for e in ds.train:  # every kept chunk has a target
        assert (e["labels"][1:] != IGNORE_INDEX).any(), e
    assert ds.num_trained == sum(int((e["labels"][1:] != IGNORE_INDEX).sum()) for e in ds.train)
    assert (
        f"data: {ds.dropped} packed examples with no trained token (context alone, such as the "
        "middle of a long prompt) were left out" in ds.summary()
    )


def test_long_text_is_cut_into_pieces_without_changing_tokens(tmp_path, tok):
    # > 8 KiB of text goes through the batched piece path; a word-level tokenizer must give the
    # same ids as one call on the whole text.
    words = "hello world how are you\n\nfine thanks\n\n\ngood a b c\n".split(" ")
    text = " ".join(words * 400)
    (tmp_path / "big.txt").write_text(text)
    ds = build_dataset(tmp_path / "big.txt", tok, seq_len=64)
    whole = tok(text, add_special_tokens=False)["input_ids"] + [ID["<eos>"]]
    got = torch.cat([e["input_ids"] for e in ds.train]).tolist()
    assert len(text) > 2 * 8192
    assert got[: len(whole)] == whole


def test_eval_split_deterministic_and_disjoint(tmp_path, tok):
    (tmp_path / "a.txt").write_text(" ".join(["a b c d e f g h"] * 50))  # 401 tokens
    ds1 = build_dataset(tmp_path / "a.txt", tok, seq_len=8, eval_fraction=0.2, seed=3)
    ds2 = build_dataset(tmp_path / "a.txt", tok, seq_len=8, eval_fraction=0.2, seed=3)
    ds3 = build_dataset(tmp_path / "a.txt", tok, seq_len=8, eval_fraction=0.2, seed=4)
    # 50 full chunks (the 1-token tail has no target); round(0.2 * 50) = 10 held out
    assert len(ds1.eval) == 10 and len(ds1.train) == 40
    ptrs = lambda d: {e["input_ids"].data_ptr() for e in d}  # noqa: E731
    assert not ptrs(ds1.eval) & ptrs(ds1.train)
    offsets = lambda d: [e["input_ids"].storage_offset() for e in d]  # noqa: E731
    assert offsets(ds1.eval) == offsets(ds2.eval) and offsets(ds1.train) == offsets(ds2.train)
    assert offsets(ds1.eval) != offsets(ds3.eval)  # another seed, another selection


# -------------------------------------------------------------------------- instruction masking
def test_instruction_without_template_labels_exactly_the_response(tmp_path, tok):
    f = write_jsonl(
        tmp_path / "qa.jsonl",
        [{"prompt": "how are you", "response": "fine thanks"}, {"prompt": "a", "response": "b c"}],
    )
    ds = build_dataset(f, tok, seq_len=64)
    (ex,) = ds.train
    x, y = ex["input_ids"].tolist(), ex["labels"].tolist()
    assert x[:10] == ids("how are you fine thanks <eos> a b c <eos>")
    m = IGNORE_INDEX
    assert y[:10] == [m, m, m] + ids("fine thanks <eos>") + [m] + ids("b c <eos>")
    assert all(v == m for v in y[10:])
    assert ds.num_labelled == 6


def test_instruction_with_chat_template_labels_exactly_the_assistant_turn(tmp_path, chat_tok):
    f = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "how are you", "response": "fine"}])
    (tmp_path / "t.txt").write_text("hello world")
    ds = build_dataset([f, tmp_path / "t.txt"], chat_tok, seq_len=16)
    x, y = ds.train[0]["input_ids"].tolist(), ds.train[0]["labels"].tolist()
    # <|user|> how are you <eos> <|assistant|> fine <eos>, then the text document
    assert x[:11] == ids("<|user|> how are you <eos> <|assistant|> fine <eos> hello world <eos>")
    trained = [i for i, v in enumerate(y) if v != IGNORE_INDEX]
    assert trained == [6, 7, 8, 9, 10]  # 'fine <eos>' of the assistant turn, then the text
    assert [y[i] for i in trained] == [x[i] for i in trained]


def test_instruction_and_text_keep_file_order(tmp_path, tok):
    f = write_jsonl(
        tmp_path / "mix.jsonl",
        [{"text": "a"}, {"prompt": "b", "response": "c"}, {"text": "d"}],
    )
    ds = build_dataset(f, tok, seq_len=8)
    assert ds.train[0]["input_ids"].tolist()[:7] == ids("a <eos> b c <eos> d <eos>")


# ------------------------------------------------------------------------------------- batching
def _global_batches(examples, micro_batch, dp_size, seed, epoch):
    per_rank = [
        list(
            iterate_batches(
                examples, micro_batch, dp_rank=r, dp_size=dp_size, seed=seed, epoch=epoch
            )
        )
        for r in range(dp_size)
    ]
    assert len({len(p) for p in per_rank}) == 1  # every rank takes the same number of steps
    return [
        torch.cat([per_rank[r][s]["input_ids"] for r in range(dp_size)])
        for s in range(len(per_rank[0]))
    ]


def _examples(n, t=3):
    rows = torch.arange(n * t).view(n, t)
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def test_dp_sharding_gives_the_same_global_batches():
    ex = _examples(23)
    ref = _global_batches(ex, micro_batch=8, dp_size=1, seed=5, epoch=2)
    for micro, dp in [(4, 2), (2, 4), (1, 8)]:
        got = _global_batches(ex, micro_batch=micro, dp_size=dp, seed=5, epoch=2)
        assert len(got) == len(ref) == 2 == steps_per_epoch(23, micro, dp)
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a, b)
    # ranks hold disjoint, contiguous shares
    b0 = next(iterate_batches(ex, 4, dp_rank=0, dp_size=2, seed=5, epoch=2))
    b1 = next(iterate_batches(ex, 4, dp_rank=1, dp_size=2, seed=5, epoch=2))
    assert torch.equal(torch.cat([b0["input_ids"], b1["input_ids"]]), ref[0])
    assert b0["input_ids"].shape == b0["labels"].shape == (4, 3)


def test_shuffle_depends_on_seed_and_epoch_only():
    ex = _examples(40)
    first = lambda **kw: next(iterate_batches(ex, 8, **kw))["input_ids"]  # noqa: E731
    assert torch.equal(first(seed=1, epoch=0), first(seed=1, epoch=0))
    assert not torch.equal(first(seed=1, epoch=0), first(seed=1, epoch=1))
    assert not torch.equal(first(seed=1, epoch=0), first(seed=2, epoch=0))
    seen = torch.cat([b["input_ids"] for b in iterate_batches(ex, 8, seed=1, epoch=0)])
    assert sorted(seen[:, 0].tolist()) == list(range(0, 120, 3))  # a permutation, each once


def test_iterate_batches_errors():
    with pytest.raises(ValueError, match=r"3 examples are fewer than one global batch of 4"):
        list(iterate_batches(_examples(3), 2, dp_rank=0, dp_size=2))
    with pytest.raises(ValueError, match=r"dp_rank=2, dp_size=2"):
        list(iterate_batches(_examples(8), 2, dp_rank=2, dp_size=2))


# --------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"foo": 1}', "no known format in the keys ['foo']; accepted formats: messages {"),
        ('{"prompt": "a"}', "keys ['prompt'] (a 'prompt' needs a 'completion' or a 'response')"),
        ('{"instruction": "a"}', "(an 'instruction' needs an 'output')"),
        ('{"text": 5}', "field 'text' must be a string, got int 5"),
        ("[1, 2]", "expected a JSON object (a record); got a JSON list"),
        ('{"text": "a"', "got invalid JSON ("),
        ('{"messages": [{"role": "user"}]}', "messages[0] needs a string 'role' and a string"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"conversations": [{"from": "bot", "value": "a"}]}', "is from 'bot'; expected one of"),
        ('{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}', "two strings"),
    ],
)
def test_malformed_jsonl_names_file_line_and_expectation(tmp_path, tok, line, expected):
    f = write_jsonl(tmp_path / "data.jsonl", [{"text": "a"}, "", line])
    with pytest.raises(DataError) as err:
        build_dataset(f, tok, seq_len=4)
    msg = str(err.value)
    assert "data.jsonl line 3: " in msg  # the blank line 2 still counts
    assert expected in msg


def test_missing_file_empty_file_bad_utf8_and_args(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        build_dataset([tmp_path / "nope.txt"], tok, 4)
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match=r"empty.txt: no text found \(the file is empty\)"):
        read_documents(tmp_path / "empty.txt")
    (tmp_path / "latin.txt").write_bytes(b"a b\nc \xe6 d\n")
    with pytest.raises(DataError, match=r"latin.txt line 2: expected UTF-8 text, found byte 0xe6"):
        read_documents(tmp_path / "latin.txt")
    (tmp_path / "a.txt").write_text("a b c")
    with pytest.raises(ValueError, match="seq_len must be an int >= 2"):
        build_dataset(tmp_path / "a.txt", tok, 1)
    with pytest.raises(ValueError, match="eval_fraction must be in"):
        build_dataset(tmp_path / "a.txt", tok, 2, eval_fraction=1.0)
    with pytest.raises(ValueError, match="leaves none to train on"):
        build_dataset(tmp_path / "a.txt", tok, 2, eval_fraction=0.9)  # 2 chunks, both eval


def test_format_detection_by_content_and_document_validation(tmp_path):
    (tmp_path / "data").write_text('{"prompt": "p", "response": "r"}\n')
    (tmp_path / "notes").write_text("{ not json, just braces }\n")
    (tmp_path / "x.txt").write_text('{"text": "kept as plain text"}\n')
    assert read_documents(tmp_path / "data") == [Document(prompt="p", response="r")]
    assert read_documents(tmp_path / "notes")[0].text.startswith("{ not json")
    assert read_documents(tmp_path / "x.txt")[0].text.startswith('{"text"')
    with pytest.raises(ValueError, match="either text"):
        Document(text="a", prompt="b", response="c")
