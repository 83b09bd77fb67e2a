"""serve's TextStream (text released as it becomes final, stop strings) and sample_token."""

from __future__ import annotations

import pytest
import torch

from quantmesh.serve.engine import sample_token
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


def test_sample_token_top_p_and_seed() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    g = torch.Generator().manual_seed(0)
    # top_p below the top token's probability keeps only that token
    assert {sample_token(logits, 1.0, 0.3, g) for _ in range(50)} == {1}
    draws = [sample_token(logits, 1.0, 1.0, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) >= {1, 2}  # both likely tokens come up
    again = [sample_token(logits, 1.0, 1.0, torch.Generator().manual_seed(s)) for s in range(40)]
    assert again == draws


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
