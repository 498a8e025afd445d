"""Token ids -> text, one token at a time, with stop strings.

A character may span several tokens (byte-level BPE splits UTF-8): text is only released
once the decoded tail no longer ends in U+FFFD. Stop strings are matched on the text; the
last `max(len(stop)) - 1` characters are held back so a partial stop string is never sent.
"""

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens of context make the first output token's leading space right.
        self.token_ids = list(prompt_token_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes ("" while a character is partial)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip
        )
        full = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full[len(prefix) :]


class StopStringMatcher:
    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0

    def feed(self, new_text: str) -> bool:
        """Add text; True when a stop string appeared (the text is cut before it)."""
        search_from = max(0, len(self.text) - self.holdback)
        self.text += new_text
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def release(self, finished: bool) -> str:
        """The text that is safe to send now (all of it once the sample is finished)."""
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.holdback)
        out = self.text[self.sent : end]
        self.sent = end
        return out


class SampleText:
    """One sample's text as its tokens arrive: detokenized, cut before the first stop
    string, with a possible stop string's beginning held back until it is settled."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self.matcher = StopStringMatcher(params.stop)
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Take a token; True once a stop string has appeared (later tokens are ignored)."""
        if not self.stopped:
            self.stopped = self.matcher.feed(self.detokenizer.add(token_id))
        return self.stopped

    def release(self, finished: bool) -> str:
        """The text that is safe to send now (all of it once the sample is finished)."""
        return self.matcher.release(finished or self.stopped)
