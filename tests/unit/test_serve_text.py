"""serve's TextStream (text released as it becomes final, stop strings) and choose_tokens (the
scheduler's batched draw)."""

from __future__ import annotations

import pytest
import torch

from quantmesh.infer.sampling import penalize
from quantmesh.serve.scheduler import Job, Sampling, choose_tokens
from quantmesh.serve.text import TextStream
from tests.e2e.test_cli_common import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _feed(stream: TextStream, ids: list[int]) -> tuple[list[str], bool]:
    out = []
    for i in ids:
        text, stopped = stream.add(i)
        out.append(text)
        if stopped:
            return out, True
    out.append(stream.flush())
    return out, False


def test_the_pieces_add_up_to_the_whole_decode(tok) -> None:
    ids = tok("To be, or not to be, that is the question:")["input_ids"] + [tok.eos_token_id]
    pieces, stopped = _feed(TextStream(tok), ids)
    assert not stopped
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_a_stop_string_ends_the_text_before_it(tok) -> None:
    ids = tok("To be, or not to be, that is the question:")["input_ids"]
    pieces, stopped = _feed(TextStream(tok, stop=["not to"]), ids)
    assert stopped
    assert "".join(pieces) == "To be, or "


def test_a_possible_stop_prefix_is_held_back(tok) -> None:
    s = TextStream(tok, stop=["or not"])
    ids = tok("To be, or")["input_ids"]
    released = "".join(s.add(i)[0] for i in ids)
    assert released == "To be, "  # "or" could still become "or not"
    text, stopped = s.add(tok("arrows")["input_ids"][0])
    assert not stopped and released + text == "To be, or arrows"


def _job(seed: int, generated: int = 0, prompt: tuple[int, ...] = (0,), **kw) -> Job:
    job = Job(0, list(prompt), 0, Sampling(max_tokens=8, **kw), lambda e: None, None, seed)  # type: ignore[arg-type]
    job.generated = generated
    return job


def choose_tokens_list(logits: torch.Tensor, jobs: list[Job]) -> list[int]:
    return choose_tokens(logits, jobs).tolist()


def test_choose_tokens_top_p_seed_and_independence_from_the_batch() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    # top_p below the top token's probability keeps only that token, whatever the noise
    low = [_job(s, temperature=1.0, top_p=0.3) for s in range(50)]
    assert set(choose_tokens_list(logits.expand(50, -1), low)) == {1}
    jobs = [_job(s, temperature=1.0) for s in range(40)]
    draws = choose_tokens_list(logits.expand(40, -1), jobs)
    assert set(draws) >= {1, 2}  # both likely tokens come up
    assert choose_tokens_list(logits.expand(40, -1), jobs) == draws  # the seed decides
    # one row alone, or beside other rows and settings: the same token
    alone = [choose_tokens_list(logits[None], [j])[0] for j in jobs]
    assert alone == draws
    mixed = [_job(99, temperature=0.0), *jobs[:5], _job(7, temperature=0.5, top_k=2)]
    assert choose_tokens_list(logits.expand(7, -1), mixed)[1:6] == draws[:5]
    # the count of generated tokens moves the noise: a seeded reply is not one token repeated
    later = choose_tokens_list(
        logits.expand(40, -1), [_job(s, 1, temperature=1.0) for s in range(40)]
    )
    assert later != draws
    # greedy rows take the argmax
    assert choose_tokens_list(logits.expand(2, -1), [_job(1), _job(2)]) == [1, 1]


def test_choose_tokens_penalizes_its_rows_only() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]] * 2)
    rep = _job(0, prompt=(1,), repetition_penalty=2.0)  # token 1 seen in the prompt: 3.0 -> 1.5
    plain = _job(0)
    assert choose_tokens_list(logits, [rep, plain]) == [2, 1]
    want = penalize(logits[:1], torch.tensor([[False, True, False, False]]), torch.zeros(1, 4), 2.0)
    assert int(want.argmax()) == 2


def _byte_level_bpe():
    """A byte-level BPE like SmolLM2's (GPT-2's byte alphabet, merges learned here on a text with
    multi-byte characters), so that characters split over tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ["Ça va? 🌊 日本語のテキスト  two  spaces.", "the sea, the waves; naïve café"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")


def test_byte_level_pieces_add_up_even_for_random_ids() -> None:
    """A byte-level BPE: multi-byte characters split over tokens, random id runs."""
    import random

    bpe = _byte_level_bpe()
    text = "Ça va? 🌊 日本語のテキスト  two  spaces.\n\nNext: don't stop."
    runs = [bpe(text)["input_ids"] + [bpe.eos_token_id]]
    # some character really is split over tokens (else this would test nothing byte-level)
    assert any("\ufffd" in bpe.decode([i]) for i in runs[0]), runs[0]
    rng = random.Random(0)
    runs += [[rng.randrange(len(bpe)) for _ in range(30)] for _ in range(50)]
    for ids in runs:
        pieces, _ = _feed(TextStream(bpe), ids)
        assert "".join(pieces) == bpe.decode(ids, skip_special_tokens=True)


def test_the_stream_decodes_as_the_tokenizer_does_with_or_without_its_wrapper(tok) -> None:
    """TextStream decodes with the fast tokenizer's own backend where transformers' `decode`
    returns exactly its text; a tokenizer that cleans up spaces keeps the wrapper, so the pieces
    add up to `decode`'s text either way."""
    from quantmesh.serve.text import _plain_backend

    bpe = _byte_level_bpe()
    assert _plain_backend(tok) is tok.backend_tokenizer
    assert _plain_backend(bpe) is bpe.backend_tokenizer
    bpe.clean_up_tokenization_spaces = True
    tok.clean_up_tokenization_spaces = True
    try:
        assert _plain_backend(bpe) is None and _plain_backend(tok) is None
        ids = tok("To be , or not to be : that is the question .")["input_ids"]
        pieces, _ = _feed(TextStream(tok), ids)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    finally:
        tok.clean_up_tokenization_spaces = False


def _byte_fallback_bpe():
    """A SentencePiece-shaped BPE (Llama 2, Mistral, Gemma): ▁ for a space, and characters out of
    its vocabulary as `<0xNN>` byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>", *bytes_])
    tk.train_from_iterator(["To be, or not to be, that is the question."] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("make", [_byte_level_bpe, _byte_fallback_bpe])
def test_logprob_bytes_are_each_token_s_own_and_join_into_the_text(make) -> None:
    """A token holding part of a character showed U+FFFD as its string and its bytes (OpenAI
    gives the token's own bytes); a SentencePiece token lost its leading space."""
    from quantmesh.serve.protocol import chat_logprobs, completion_logprobs, token_bytes

    tk = make()
    text = "To be, 日本 🌊 or not"
    ids = tk(text, add_special_tokens=False)["input_ids"]
    raw = [token_bytes(tk, i) for i in ids]
    joined = b"".join(raw).decode("utf-8")
    assert joined == (" " + text if make is _byte_fallback_bpe else text)  # ▁ before the first
    partial = [b for b in raw if not _utf8(b)]
    assert partial, "no character split over tokens: this would test nothing"
    content = chat_logprobs(tk, [(i, -1.0, [(i, -1.0)]) for i in ids])["content"]
    assert [bytes(c["bytes"]) for c in content] == raw
    assert [bytes(c["top_logprobs"][0]["bytes"]) for c in content] == raw
    for c, b in zip(content, raw, strict=True):  # whole UTF-8: text; else bytes:\xNN
        want = b.decode() if _utf8(b) else "bytes:" + "".join(f"\\x{x:02x}" for x in b)
        assert c["token"] == want
    legacy = completion_logprobs(tk, [(i, -1.0, []) for i in ids])
    assert legacy["tokens"] == [c["token"] for c in content]
    # offsets count whole characters: a token's offset is where its first whole character starts
    done = [len(b"".join(raw[:k]).decode("utf-8", "ignore")) for k in range(len(raw))]
    assert legacy["text_offset"] == done


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
