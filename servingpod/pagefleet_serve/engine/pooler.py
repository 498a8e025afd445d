"""Pooling for an embed engine: a prompt's final hidden states (after the model's last
norm, what transformers' `AutoModel` returns as `last_hidden_state`) become one vector.

A prompt may be prefilled in chunks over several steps, batched with other prompts; each
step pools what it computed of each embedding sequence into `Sequence.pooled_chunks`, keyed
by the chunk's first position: mean pooling keeps every chunk's sum (float32), last-token
pooling the last position's state, cls the first's. The step that completes the prompt
hands the vector out (`embedding`), L2-normalised when the model says so. Every position
must be computed for mean and cls pooling, so an embed engine runs without prefix caching
(a cache hit skips positions), see `LLMEngine`.
"""

import torch

from pagefleet_serve.config import PoolingConfig
from pagefleet_serve.engine.scheduler import ScheduledSeq
from pagefleet_serve.engine.sequence import Sequence


class Pooler:
    def __init__(self, config: PoolingConfig) -> None:
        self.config = config

    def accumulate(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor, ends: list[int]):
        """Pool this step's rows of each embedding sequence; `ends[i]`: the end of item i's
        rows in `hidden` (one row per input token)."""
        method = self.config.method
        for item, end in zip(scheduled, ends, strict=True):
            seq = item.seq
            if not seq.pooling:
                continue
            first = seq.num_computed_tokens
            rows = hidden[end - item.num_new_tokens : end]
            if method == "mean":
                seq.pooled_chunks[first] = rows.float().sum(dim=0)
            elif method == "last" and first + item.num_new_tokens == seq.num_tokens:
                seq.pooled_chunks[first] = rows[-1].float()
            elif method == "cls" and first == 0:
                seq.pooled_chunks[first] = rows[0].float()

    def embedding(self, seq: Sequence) -> list[float]:
        """The vector of a sequence whose prompt has been computed whole."""
        chunks = list(seq.pooled_chunks.values())
        vector = torch.stack(chunks).sum(dim=0)
        if self.config.method == "mean":
            vector = vector / seq.num_tokens
        if self.config.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        seq.pooled_chunks.clear()
        return vector.cpu().tolist()
