"""The incremental detokenizer's parts on their own (no model): the byte-level alphabet
against GPT-2's reference, the bytes a token contributes (byte-level, SentencePiece's
`<0xNN>` byte fallback, skipped special tokens, a tokenizer without a fast backend), and
the stop-string matcher where a stop string opens the text or occurs twice in one
token's text."""

import json
import random

import pytest
from pagefleet_serve.frontend.detokenizer import (
    _BYTE_LEVEL,
    IncrementalDetokenizer,
    StopStringMatcher,
    TokenBytes,
    _byte_level_alphabet,
)
from pagefleet_serve.frontend.tokenizer import load_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode


def sentencepiece(directory, decoder):
    """A SentencePiece-style tokenizer: whole words are "▁" pieces, bytes `<0xNN>` pieces,
    `<s>` its special token; saved and loaded through the product's loader as a model
    directory would be."""
    words = ["<unk>", "<s>", "▁Price:", "▁5", *(f"<0x{b:02X}>" for b in range(256))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoder
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(f"file://{directory}")


@pytest.fixture(scope="module")
def fallback_tokenizer(tmp_path_factory):
    """Llama 2's decoder: "▁" is a space, `<0xNN>` pieces are bytes, and the text's first
    space is stripped (so a piece decoded alone loses its leading space)."""
    decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return sentencepiece(tmp_path_factory.mktemp("fallback"), decoder)


@pytest.fixture(scope="module")
def literal_tokenizer(tmp_path_factory):
    """The same vocabulary with a decoder that has no byte fallback: `<0xNN>` pieces
    decode as their six characters."""
    return sentencepiece(tmp_path_factory.mktemp("literal"), decoders.Metaspace())


def stream(tokenizer, token_ids, prompt=(1,), skip_special_tokens=True):
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt), skip_special_tokens)
    return [detokenizer.add(t) for t in token_ids]


def test_the_byte_level_alphabet_is_gpt2s():
    """Every byte's character in a byte-level piece, as GPT-2's `bytes_to_unicode` (the
    reference `transformers` ships) writes it: printable Latin-1 bytes as themselves, the
    68 others as the characters from U+0100 up, in byte order. Called here, not read from
    the module's copy, which is made once at import."""
    reference = {char: byte for byte, char in bytes_to_unicode().items()}
    assert _byte_level_alphabet() == reference
    assert reference == _BYTE_LEVEL  # the module's copy, made by the same function


@pytest.mark.parametrize("specials", [0, 1, 4, 9])
def test_the_first_token_keeps_its_space_after_skipped_special_tokens(fallback_tokenizer, specials):
    """A prompt ending in skipped special tokens (a chat template's): the first output word
    keeps its leading space, as the decode of prompt and output less the prompt's has it,
    however many specials end the prompt (the context is the last few that are text)."""
    prompt = [2, *[1] * specials]  # "▁Price:", then <s> x specials
    reference = fallback_tokenizer.decode([*prompt, 3, 3], skip_special_tokens=True)
    reference = reference[len(fallback_tokenizer.decode(prompt, skip_special_tokens=True)) :]
    assert reference == " 5 5"
    assert "".join(stream(fallback_tokenizer, [3, 3], prompt)) == reference
    # A prompt of specials alone: the text opens with the first word, as in the reference.
    assert stream(fallback_tokenizer, [3, 3], [1] * specials) == ["5", " 5"]


def test_a_byte_level_piece_gives_its_bytes_and_a_skipped_special_token_none(
    smollm_tokenizer, byte_token
):
    """Byte-level pieces spell bytes (" café" is b" caf\\xc3\\xa9", one byte token is its
    byte); a special token gives nothing when special tokens are skipped, and its text's
    bytes when they are not."""
    token_bytes = TokenBytes(smollm_tokenizer, skip_special_tokens=True)
    (cafe,) = smollm_tokenizer.encode(" café", add_special_tokens=False)
    assert token_bytes(cafe) == " café".encode()
    assert token_bytes(byte_token(0xE2)) == b"\xe2"
    special = smollm_tokenizer.all_special_ids[0]
    assert token_bytes(special) == b""
    kept = TokenBytes(smollm_tokenizer, skip_special_tokens=False)
    assert kept(special) == smollm_tokenizer.convert_ids_to_tokens(special).encode()


def test_a_skipped_special_token_inside_a_character_holds_nothing_back(
    smollm_tokenizer, byte_token
):
    """A special token between the bytes of "€" decodes to nothing when skipped: the
    character is still partial after it (nothing is sent, no U+FFFD), and whole after its
    last byte."""
    euro = [byte_token(b) for b in (0xE2, 0x82, 0xAC)]
    special = smollm_tokenizer.all_special_ids[0]
    assert stream(smollm_tokenizer, [euro[0], euro[1], special, euro[2]]) == ["", "", "", "€"]
    assert stream(smollm_tokenizer, [euro[0], special, euro[1], euro[2]]) == ["", "", "", "€"]


def test_a_byte_fallback_piece_is_its_byte(fallback_tokenizer):
    """SentencePiece writes a byte it falls back to as `<0xNN>` (hex, either case of
    digit): that piece is the one byte, not its six characters, even though each of them
    is in the byte-level alphabet; a word piece is its text."""
    token_bytes = TokenBytes(fallback_tokenizer, skip_special_tokens=True)
    assert not token_bytes.byte_level
    for byte in (0x41, 0x82, 0xAC, 0xC3, 0xE2, 0xFF):
        token = fallback_tokenizer.convert_tokens_to_ids(f"<0x{byte:02X}>")
        assert token_bytes(token) == bytes([byte])
    assert token_bytes(fallback_tokenizer.convert_tokens_to_ids("▁5")) == "▁5".encode()


def test_a_character_split_over_byte_fallback_pieces_is_held_back(fallback_tokenizer):
    """ "é" (c3 a9) as two byte-fallback pieces: nothing is sent after the first (its byte
    is a partial character, not a U+FFFD to stream), the character after the second."""
    c3, a9 = (fallback_tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xC3, 0xA9))
    five = fallback_tokenizer.convert_tokens_to_ids("▁5")
    price = fallback_tokenizer.convert_tokens_to_ids("▁Price:")
    assert stream(fallback_tokenizer, [five, c3, a9, five], prompt=[price]) == [
        " 5",
        "",
        "é",
        " 5",
    ]


@pytest.mark.parametrize("character", ["€", "😀"])  # 3 and 4 bytes
def test_a_character_of_three_or_four_byte_fallback_pieces_is_sent_whole(
    fallback_tokenizer, character
):
    """Llama 2's decoder writes one U+FFFD per byte of a partial character ("��" after two
    of the euro sign's three bytes): none of them is sent, and the character is sent whole
    once its last byte arrives (it was dropped: the first U+FFFD went out instead)."""
    pieces = [fallback_tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in character.encode()]
    five = fallback_tokenizer.convert_tokens_to_ids("▁5")
    price = fallback_tokenizer.convert_tokens_to_ids("▁Price:")
    sent = stream(fallback_tokenizer, [five, *pieces, five], prompt=[price])
    assert sent == [" 5", *[""] * (len(pieces) - 1), character, " 5"]


def test_byte_fallback_streams_the_decoded_text(fallback_tokenizer):
    """Random runs of words and 2-, 3- and 4-byte characters as byte-fallback pieces, the
    last character perhaps cut short: each delta is whole text, and the stream is the text
    the tokenizer decodes, less only the U+FFFDs of a character still partial at the end.
    (A run of bytes that is not UTF-8 is out of scope: the ByteFallback decoder turns a
    whole run of byte pieces into U+FFFDs when any of it is invalid.)"""
    rng = random.Random(0)
    ids = fallback_tokenizer.convert_tokens_to_ids
    words = [[ids("▁5")], [ids("▁Price:")]]
    characters = [[ids(f"<0x{b:02X}>") for b in c.encode()] for c in "é€😀"]
    price = ids("▁Price:")
    context = fallback_tokenizer.decode([price])
    for _ in range(300):
        units = [rng.choice(words + characters) for _ in range(rng.randrange(1, 12))]
        character = rng.choice(characters)
        cut = character[: rng.randrange(len(character))]  # bytes of a character to come
        tokens = [t for unit in units for t in unit]
        deltas = stream(fallback_tokenizer, [*tokens, *cut], prompt=[price])
        whole = fallback_tokenizer.decode([price, *tokens])[len(context) :]
        assert "".join(deltas) == whole, (units, cut)
        assert "\ufffd" not in whole


def test_a_skipped_special_token_sends_nothing_and_keeps_the_next_words_space(
    fallback_tokenizer,
):
    """A skipped special token adds no text: it sends nothing, and the window it is decoded
    in stays where it was, so the word after it is still decoded after the prompt's text
    and keeps its leading space (decoded alone, "▁5" loses it)."""
    bos = fallback_tokenizer.convert_tokens_to_ids("<s>")
    five = fallback_tokenizer.convert_tokens_to_ids("▁5")
    price = fallback_tokenizer.convert_tokens_to_ids("▁Price:")
    assert bos in fallback_tokenizer.all_special_ids
    assert fallback_tokenizer.decode([five]) == "5"
    assert stream(fallback_tokenizer, [bos, five, bos, bos, five], prompt=[price]) == [
        "",
        " 5",
        "",
        "",
        " 5",
    ]


def test_a_piece_that_only_looks_like_a_byte_is_the_text_its_decoder_makes(literal_tokenizer):
    """With a decoder that has no byte fallback, `<0xE2>` decodes as those six characters:
    the text is whole, and all of it is sent at once (the piece's byte is not a partial
    character: only a text that ends in U+FFFD can end in one)."""
    e2 = literal_tokenizer.convert_tokens_to_ids("<0xE2>")
    price = literal_tokenizer.convert_tokens_to_ids("▁Price:")
    assert literal_tokenizer.decode([price, e2]) == "Price:<0xE2>"
    assert stream(literal_tokenizer, [e2, e2], prompt=[price]) == ["<0xE2>", "<0xE2>"]


class PythonTokenizer:
    """A tokenizer with no `tokenizers` backend (as a slow, pure-Python one): pieces are
    SentencePiece's, `<0xNN>` for a byte; it decodes as SentencePiece does, invalid bytes
    as U+FFFD."""

    def __init__(self) -> None:
        self.all_special_ids = [0]
        self.pieces = ["<s>", "▁a", *(f"<0x{b:02X}>" for b in range(256))]

    def convert_ids_to_tokens(self, token_id):
        return self.pieces[token_id] if token_id < len(self.pieces) else None

    def decode(self, ids, skip_special_tokens=False):
        data = b""
        for token_id in ids:
            piece = self.convert_ids_to_tokens(token_id)
            if piece is None or (skip_special_tokens and token_id in self.all_special_ids):
                continue
            if piece.startswith("<0x"):
                data += bytes([int(piece[3:5], 16)])
            else:
                data += piece.replace("▁", " ").encode()
        return data.decode("utf-8", "replace")


def test_a_tokenizer_without_a_fast_backend_streams_its_byte_fallback_pieces():
    """A tokenizer without `backend_tokenizer` is not byte-level: its `<0xNN>` pieces are
    read as bytes, so "€" split over three of them is held back until whole."""
    tokenizer = PythonTokenizer()
    assert not TokenBytes(tokenizer, skip_special_tokens=True).byte_level
    euro = [2 + b for b in (0xE2, 0x82, 0xAC)]
    assert stream(tokenizer, [1, *euro, 1], prompt=[1]) == [" a", "", "", "€", " a"]
    assert TokenBytes(tokenizer, skip_special_tokens=True)(9999) == b""  # no piece: nothing


@pytest.mark.parametrize("text", ["stop here", "stop"])
def test_a_stop_string_at_the_very_start_of_the_text_is_found(text):
    """A stop string that opens the output (index 0) stops it, with no text before it."""
    matcher = StopStringMatcher(("stop",))
    assert matcher.feed(text)
    assert matcher.text == "" and matcher.release(True) == ""


def test_a_stop_string_twice_in_one_piece_of_text_cuts_at_the_first():
    """One token's text may hold a stop string twice: the text is cut before the first."""
    matcher = StopStringMatcher(("na",))
    assert not matcher.feed("ba")
    assert matcher.feed("nana!")
    assert matcher.release(True) == "ba"
