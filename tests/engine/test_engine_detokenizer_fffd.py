"""The incremental detokenizer tells a partial UTF-8 character from a real U+FFFD (issue 42,
item 9) on the real SmolLM2 tokenizer: token 24211 is the character U+FFFD itself, and
byte tokens split "€" (e2 82 ac). A real U+FFFD streams at once, only a partial
character's bytes are held back, and a stream costs time linear in its tokens."""

import random

import pytest
from pagefleet_serve.frontend.detokenizer import IncrementalDetokenizer

FFFD_TOKEN = 24211


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer):
    return smollm_tokenizer


class CountingTokenizer:
    """The real tokenizer, counting the tokens it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def stream(tokenizer, token_ids, prompt=(1,)):
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt), skip_special_tokens=True)
    return [detokenizer.add(t) for t in token_ids]


def test_a_real_replacement_character_streams_at_once_in_linear_time(tokenizer):
    assert tokenizer.decode([FFFD_TOKEN]) == "\ufffd"
    counting = CountingTokenizer(tokenizer)
    deltas = stream(counting, [FFFD_TOKEN] * 2000)
    assert deltas == ["\ufffd"] * 2000  # nothing waited for a character after it
    assert counting.decoded < 10 * 2000  # a window of a few tokens, not all of them


def test_only_a_partial_characters_bytes_are_held_back(tokenizer, byte_token):
    euro = [byte_token(b) for b in (0xE2, 0x82, 0xAC)]
    a = tokenizer.encode("a", add_special_tokens=False)
    assert stream(tokenizer, [*a, *euro]) == ["a", "", "", "€"]
    # A real U+FFFD just before a partial character is sent without waiting for it.
    assert stream(tokenizer, [FFFD_TOKEN, *euro]) == ["\ufffd", "", "", "€"]
    # Lead bytes that nothing continues are real U+FFFDs, each sent once the next byte
    # shows it invalid, in linear time.
    counting = CountingTokenizer(tokenizer)
    deltas = stream(counting, [euro[0]] * 1000)
    assert deltas == ["", *["\ufffd"] * 999]
    assert counting.decoded < 10 * 1000


def test_the_streamed_text_is_the_decoded_text(tokenizer, byte_token):
    rng = random.Random(0)
    words = tokenizer.encode(" the sea, 海 and € café", add_special_tokens=False)
    pool = [*words, FFFD_TOKEN, *(byte_token(b) for b in (0xE2, 0x82, 0xAC, 0xE6, 0xB5, 0xB7))]
    for _ in range(200):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 30))]
        streamed = "".join(stream(tokenizer, ids, prompt=words[:3]))
        context = tokenizer.decode(words[:3])
        expected = tokenizer.decode(words[:3] + ids)[len(context) :]
        # Only a character still partial at the end is missing.
        assert streamed in (expected, expected.removesuffix("\ufffd")), ids
