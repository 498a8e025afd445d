"""Token ids -> text, one token at a time, with stop strings.

A character may span several tokens (byte-level BPE splits UTF-8): the bytes of a character
still incomplete are held back, and only they; a U+FFFD the tokens really spell (an invalid
sequence, or the character itself, token 24211 in SmolLM2) is text like any other. Each
token is decoded within a window of a few tokens, so a stream costs time linear in its
tokens. Stop strings are matched on the text; the last `max(len(stop)) - 1` characters are
held back so a partial stop string is never sent.
"""

import codecs
import re

from pagefleet_serve.reasoning.base import REASONING, ReasoningStream

_REPLACEMENT = "\ufffd"
# How far back into the prompt the first decode's context is looked for.
CONTEXT_WINDOW = 64
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character each byte is written as in a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


class TokenBytes:
    """The UTF-8 bytes a token contributes to the text, read from its vocabulary piece:
    byte-level pieces (GPT-2, Llama 3, SmolLM2) spell bytes; SentencePiece spells a byte it
    falls back to as `<0xNN>`. Other pieces are whole characters."""

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = backend is not None and "ByteLevel(" in repr(backend.decoder)
        self.skipped = set(tokenizer.all_special_ids) if skip_special_tokens else set()

    def __call__(self, token_id: int) -> bytes:
        if token_id in self.skipped:
            return b""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self.byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.encode()


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_bytes = TokenBytes(tokenizer, skip_special_tokens)
        # A few prompt tokens of context make the first output token's leading space right:
        # the last ones that are text, since a skipped special token decodes to nothing (and
        # a SentencePiece decoder strips the leading space of the first piece after it).
        skipped = self.token_bytes.skipped
        self.token_ids = [t for t in prompt_token_ids[-CONTEXT_WINDOW:] if t not in skipped][-4:]
        # The window decoded: text of [prefix_offset, read_offset) was sent; of the text
        # after it, the first `sent` characters were sent too (all but a partial character).
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.sent = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self.token_ids[start:end]
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes ("" while a character is partial)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset)
        if len(full) <= len(prefix):
            return ""
        new = full[len(prefix) :]
        boundary = self._last_character_boundary() if full.endswith(_REPLACEMENT) else None
        if boundary is None:  # the text ends on a whole character
            out = new[self.sent :]
            self.prefix_offset, self.read_offset, self.sent = (
                self.read_offset,
                len(self.token_ids),
                0,
            )
            return out
        if not self.token_bytes.byte_level:
            # SentencePiece's byte fallback decodes a partial character's bytes as one
            # U+FFFD each (and the whole run of byte pieces they end, whole characters too,
            # as U+FFFDs), so nothing of this decode may be sent. Nothing whole waits either:
            # its pieces are whole characters or single bytes, so every character before the
            # partial one was sent by the token that completed it.
            return ""
        # Byte-level BPE decodes a partial character as one U+FFFD: send all before it, and
        # move the window up to the last token that ends on a character boundary, so that
        # it stays a few tokens long.
        out = new[self.sent : -1]
        self.sent += len(out)
        if boundary > self.read_offset:
            head = self._decode(self.read_offset, boundary)
            self.prefix_offset, self.read_offset = self.read_offset, boundary
            self.sent = max(0, self.sent - len(head))
        return out

    def _last_character_boundary(self) -> int | None:
        """None when the unsent tokens' bytes end on a whole character; else the index of
        the last token boundary before that partial character at which the text splits
        cleanly (read_offset when none does)."""
        pieces = [self.token_bytes(t) for t in self.token_ids[self.read_offset :]]
        data = b"".join(pieces)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(data)
        partial = len(decoder.getstate()[0])
        if not partial:
            return None
        offset, boundary = 0, self.read_offset
        for index, piece in enumerate(pieces):
            if offset + len(piece) > len(data) - partial:
                break
            offset += len(piece)
            boundary = self.read_offset + index + 1
        # No whole character may straddle the boundary (it would decode apart as U+FFFD).
        whole = data.decode("utf-8", "replace")
        if (
            data[:offset].decode("utf-8", "replace") + data[offset:].decode("utf-8", "replace")
            != whole
        ):
            return self.read_offset
        return boundary


class StopStringMatcher:
    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, new_text: str, search: bool = True) -> bool:
        """Add text; True when a stop string appeared (the text is cut before it). Not
        `search`: the text cannot stop the sample yet (min_tokens)."""
        search_from = max(0, len(self.text) - self.holdback)
        self.text += new_text
        if not search:
            return False
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            at, self.matched = min(hits)
            self.text = self.text[:at]
            return True
        return False

    def release(self, finished: bool) -> str:
        """The text that is safe to send now (all of it once the sample is finished)."""
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.holdback)
        out = self.text[self.sent : end]
        self.sent = end
        return out


class SampleText:
    """One sample's text as its tokens arrive: detokenized, split into thinking and answer
    by the request's reasoning stream (if it has one), the answer cut before the first
    stop string, with a possible stop string's beginning held back until it is settled.
    Stop strings end the answer, never the thinking."""

    def __init__(
        self, tokenizer, prompt_token_ids: list[int], params, reasoning: ReasoningStream | None
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self.matcher = StopStringMatcher(params.stop)
        self.stopped = False
        self.min_tokens = params.min_tokens
        self.num_tokens = 0
        self.reasoning = reasoning
        self.thought = ""  # thinking not yet released
        self.num_reasoning_tokens = 0  # released

    def add(self, token_id: int) -> bool:
        """Take a token; True once a stop string has appeared (later tokens are ignored;
        none before min_tokens)."""
        if self.stopped:
            return True
        self.num_tokens += 1
        text = self.detokenizer.add(token_id)
        if self.reasoning is None:
            self._answer(text)
        else:
            self._route(self.reasoning.feed(token_id, text))
        return self.stopped

    def release(self, finished: bool) -> str:
        """The answer's text that is safe to send now (all of it once the sample is
        finished); `release_reasoning` after it."""
        if finished and self.reasoning is not None and not self.stopped:
            self._route(self.reasoning.finish())
        return self.matcher.release(finished or self.stopped)

    def release_reasoning(self) -> tuple[str, int]:
        """The thinking's text not sent yet, and the thinking tokens not counted yet."""
        if self.reasoning is None:
            return "", 0
        text, self.thought = self.thought, ""
        count = self.reasoning.num_reasoning_tokens - self.num_reasoning_tokens
        self.num_reasoning_tokens += count
        return text, count

    def _route(self, pieces: list[tuple[str, str]]) -> None:
        for channel, text in pieces:
            if channel == REASONING:
                self.thought += text
            elif not self.stopped:
                self._answer(text)

    def _answer(self, text: str) -> None:
        self.stopped = self.matcher.feed(text, self.num_tokens > self.min_tokens)
