"""Draft-model proposals: a smaller model with the target's vocabulary proposes the next
k tokens greedily, one batched forward pass per token.

The draft runs in its own `ModelRunner` with its own paged KV cache over the target's
block ids: a block holds both models' K/V, the engine splits its KV budget into blocks
costing both (so `kv_cache_usage` stays the fraction of memory in use), and the target's
runner runs the draft over every batch it runs itself. So the draft's cache holds every
position the target has computed, prefix-cache hits and recompute included; what the
draft writes while proposing lies past the computed positions (in lookahead slots the
scheduler allocated, `BlockManager.holds_slots`), where rejected tokens are overwritten
by later steps exactly as the target's are.

Greedy drafts are deterministic proposals, so `verify` accepts them by the rule that keeps
the output distribution the target's for any sampling settings.
"""

import torch

from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.model_runner import ModelRunner
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.loader.model_loader import LoadedModel


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, block_manager: BlockManager) -> None:
        self.runner = runner
        self.block_manager = block_manager

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: int) -> list[list[int]]:
        """`num_tokens` greedy drafts for each decoding sequence whose lookahead slots are
        allocated and its own; none for the others (this step only)."""
        ready = [i for i, seq in enumerate(seqs) if self.block_manager.holds_slots(seq, num_tokens)]
        drafts: list[list[int]] = [[] for _ in seqs]
        if not ready:
            return drafts
        batch = [seqs[i] for i in ready]
        tokens = [seq.token_ids[-1] for seq in batch]
        tables = [seq.block_table for seq in batch]
        for offset in range(num_tokens):
            starts = [seq.num_computed_tokens + offset for seq in batch]
            hidden = self.runner.forward(tokens, starts, [1] * len(batch), tables)
            tokens = self.runner.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, token in zip(ready, tokens, strict=True):
                drafts[i].append(token)
        return drafts


def check_vocabulary(draft: LoadedModel, target: ModelConfig) -> None:
    """Refuse a draft whose token ids do not mean what the target's mean (the frontend
    compares their tokenizers: `frontend.tokenizer.load_engine_tokenizer`)."""
    if draft.config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft {draft.name} has a vocabulary of "
            f"{draft.config.vocab_size} tokens and the target {target.vocab_size}; a draft "
            "must share the target's tokenizer"
        )
