from __future__ import annotations

import random
from functools import partial

import pytest

from engine.io.detokenizer import IncrementalDetokenizer, fast_decode
from tests.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _stream(tokenizer, text: str, stop: list[str]):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [5, 6], stop)
    deltas = []
    for token_id in ids:
        delta, hit = detok.push([token_id])
        deltas.append(delta)
        if hit is not None:
            return deltas, hit
    deltas.append(detok.flush())
    return deltas, None


def test_multibyte_characters_are_never_split(tokenizer):
    text = "héllo wörld 😀 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # some characters take several byte tokens
    deltas, hit = _stream(tokenizer, text, [])
    assert hit is None
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_partial_stop_string_is_held_back_then_released(tokenizer):
    deltas, hit = _stream(tokenizer, "abc STx and more", ["STOP"])
    assert hit is None
    assert "".join(deltas) == "abc STx and more"
    # "S" and "ST" could start "STOP": they come out only once "x" rules it out
    assert deltas[4:7] == ["", "", "STx"]


def test_stop_string_ends_the_text_before_it(tokenizer):
    deltas, hit = _stream(tokenizer, "one two STOP three", ["STOP", "zzz"])
    assert hit == "STOP"
    assert "".join(deltas) == "one two "


def test_earliest_stop_string_wins(tokenizer):
    deltas, hit = _stream(tokenizer, "xx END yy HALT", ["HALT", "END"])
    assert hit == "END" and "".join(deltas) == "xx "


def test_several_tokens_at_once(tokenizer):
    ids = tokenizer.encode("spec tokens arrive in runs", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], [])
    text = "".join(detok.push(ids[i : i + 3])[0] for i in range(0, len(ids), 3))
    assert text + detok.flush() == "spec tokens arrive in runs"


def _push_all(detok, tokenizer, text: str, num_unchecked: int = 0):
    deltas, hit = [], None
    for i, token_id in enumerate(tokenizer.encode(text, add_special_tokens=False)):
        delta, hit = detok.push([token_id], check_stop=i >= num_unchecked)
        deltas.append(delta)
        if hit is not None:
            break
    return deltas, hit


def test_a_stop_string_counts_only_when_it_ends_in_checked_text(tokenizer):
    """min_tokens: "END" ending in the first 6 (unchecked) tokens is ignored, even when
    checking starts right after it; the next one stops the text."""
    detok = IncrementalDetokenizer(tokenizer, [], ["END"])
    deltas, hit = _push_all(detok, tokenizer, "a END b END c", num_unchecked=5)
    assert hit == "END" and "".join(deltas) == "a END b "


def test_include_stop_holds_nothing_back_and_keeps_the_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], ["STOP"], include_stop=True)
    deltas, hit = _push_all(detok, tokenizer, "go STOP and more")
    assert hit == "STOP" and "".join(deltas) == "go STOP"
    assert deltas[3:6] == ["S", "T", "O"]  # emitted at once: nothing is ever retracted
    late = IncrementalDetokenizer(tokenizer, [], ["ab"], include_stop=True)
    deltas, hit = _push_all(late, tokenizer, "xab ab", num_unchecked=3)
    assert hit == "ab" and "".join(deltas) == "xab ab"


def _decodes_alike(tokenizer, decode, vocab_size: int) -> None:
    rng = random.Random(0)
    for n in (0, 1, 2, 7, 40):
        for _ in range(30):
            ids = [rng.randrange(vocab_size) for _ in range(n)]
            assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_fast_decode_is_the_wrappers_decode(tokenizer):
    """The detokenizer's decode skips transformers' wrapper only where the wrapper adds
    nothing: the same text for any ids (special tokens, bytes of a character split over
    tokens), and the wrapper itself where the tokenizer cleans up spaces or a class
    overrides decode."""
    decode = fast_decode(tokenizer)
    assert isinstance(decode, partial) and decode.func == tokenizer.backend_tokenizer.decode
    _decodes_alike(tokenizer, decode, len(tokenizer))

    class Shouting(type(tokenizer)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens, **kwargs).upper()

    cleaned = make_tokenizer()
    cleaned.clean_up_tokenization_spaces = True
    shouting = make_tokenizer()
    shouting.__class__ = Shouting
    for other in (cleaned, shouting):
        decode = fast_decode(other)
        assert decode.func != other.backend_tokenizer.decode
        _decodes_alike(other, decode, len(other))


@pytest.mark.slow
def test_fast_decode_is_the_default_models_decode():
    from engine.loader import load_model

    tokenizer = load_model(None, dtype="float32", device="cpu").tokenizer
    decode = fast_decode(tokenizer)
    assert isinstance(decode, partial) and decode.func == tokenizer.backend_tokenizer.decode
    _decodes_alike(tokenizer, decode, len(tokenizer))
