"""N-gram prompt lookup: when the sequence's last n tokens occurred earlier (in the prompt
or the output so far), propose the tokens that followed them there.

Cheap and model-free; it pays off when the answer repeats its input (editing a document,
reformatting code, quoting), and proposes nothing when there is no earlier occurrence.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagefleet_serve.engine.sequence import Sequence


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, seqs: list[Sequence], num_tokens: int) -> list[list[int]]:
        """Each sequence's drafts (up to `num_tokens`; none without an earlier match)."""
        return [self.lookup(seq.token_ids, num_tokens) for seq in seqs]

    def lookup(self, token_ids: list[int], max_num_tokens: int) -> list[int]:
        """Up to `max_num_tokens` tokens following the most recent earlier occurrence of the
        longest suffix (of prompt_lookup_max down to prompt_lookup_min tokens) that has one."""
        if max_num_tokens < 1 or len(token_ids) < self.prompt_lookup_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(
            min(self.prompt_lookup_max, len(tokens) - 1), self.prompt_lookup_min - 1, -1
        ):
            suffix = tokens[-n:]
            # Windows starting before the suffix itself, each followed by at least one token.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + max_num_tokens].tolist()
        return []
