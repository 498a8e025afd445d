"""One generated sample: its tokens, its progress through the model, its KV blocks."""

import enum
import itertools
from dataclasses import dataclass, field

import torch

from pagefleet_serve.engine.penalties import TokenCounts
from pagefleet_serve.messages import ImageInput
from pagefleet_serve.outputs import TokenLogprob
from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.structured.thinking_gate import OutputConstraint


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """A request's prompt plus one sample's output tokens.

    `num_computed_tokens` catches up with `num_tokens` within the step budget: that one
    rule covers prefill, chunked prefill, prefix-cache hits, decode and recompute after
    preemption. A request with n > 1 starts as one sequence and forks into n when its
    prompt is done (`num_samples`).
    """

    request_id: str
    sample_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    # Generators of the siblings a request with n > 1 forks into when its prompt is done.
    sibling_generators: list[torch.Generator | None] = field(default_factory=list)
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, by position
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_prefix_hit_tokens: int = 0  # tokens reused from the prefix cache on first admission
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    # Draft tokens proposed for the next step (speculative decoding); never part of
    # token_ids until the target model has accepted them.
    spec_token_ids: list[int] = field(default_factory=list)
    # Advances with output tokens only, so recompute, prefix hits and chunks leave it be.
    grammar: OutputConstraint | None = None
    # The penalties' counts on the device, from the first sampling on (`penalty_counts`).
    token_counts: TokenCounts | None = None
    # The LoRA adapter the sequence runs with (its id, unique in the process; None: the
    # base model), and the device slot holding it while the sequence runs.
    lora_id: int | None = None
    lora_slot: int | None = None
    # An embedding request (see engine/pooler.py): no sampling; its prefill's final hidden
    # states pooled per chunk, by the chunk's first position (a retried step rewrites its
    # own chunk, a preemption clears them).
    pooling: bool = False
    pooled_chunks: dict[int, torch.Tensor] = field(default_factory=dict)
    # Who sent the request (the peer's address; "" offline): the scheduler's fairness key.
    client: str = ""
    # A hybrid model's: the state slot of its recurrent layers' rows while it runs, and
    # before an n > 1 fork the slots its siblings take (see engine/state_slots.py).
    state_slot: int | None = None
    sibling_state_slots: list[int] = field(default_factory=list)
    # With params.prompt_logprobs: [p] scores prompt token p + 1 (from position p's logits),
    # written chunk by chunk as the prompt is computed (a recompute rewrites its chunk).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # A vision-language model's images (their pixels, hashes and the prompt tokens each
    # one's embeddings replace), in prompt order.
    images: tuple[ImageInput, ...] = ()

    @property
    def seq_id(self) -> tuple[str, int]:
        return (self.request_id, self.sample_index)

    @property
    def num_samples(self) -> int:
        """Samples this sequence's next token fans out to (n before the fork, else 1)."""
        return 1 + len(self.sibling_generators)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def penalty_counts(self, vocab: int, device: torch.device) -> TokenCounts | None:
        """The token counts the sampler's penalties read, built when the sequence first
        samples and brought up to date with the tokens appended since; None when the
        request sets no penalty."""
        params = self.params
        if not params.needs_penalties:
            return None
        if self.token_counts is None:
            prompt = self.token_ids[: self.num_prompt_tokens]
            repetition = params.repetition_penalty != 1.0  # the only one reading the prompt
            self.token_counts = TokenCounts.build(prompt, vocab, device, repetition)
        self.token_counts.catch_up(self.token_ids, self.num_prompt_tokens)
        return self.token_counts

    def banned_token_ids(self, num_drafts_before: int = 0) -> tuple[int, ...]:
        """The tokens the next draw (after `num_drafts_before` draft tokens) may not pick:
        EOS and the stop token ids while the output is shorter than min_tokens."""
        params = self.params
        if self.num_output_tokens + num_drafts_before >= params.min_tokens:
            return ()
        eos = () if self.eos_token_id is None or params.ignore_eos else (self.eos_token_id,)
        return (*eos, *params.stop_token_ids)

    def penalty_token_ids(self) -> tuple[list[int], list[int]]:
        """(output, prompt) token ids as the penalties read them, for the rows that carry
        them as lists (the verification of drafts), copied only when the request sets a
        penalty (the prompt only for the repetition penalty)."""
        params = self.params
        if not params.needs_penalties:
            return [], []
        repetition = params.repetition_penalty != 1.0
        return self.output_token_ids, self.token_ids[: self.num_prompt_tokens] if repetition else []

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority (lower first), then arrival."""
        return (self.priority, self.arrival_order)

    def fork(self, sample_index: int, generator: torch.Generator | None) -> "Sequence":
        """A sibling sample sharing everything computed so far (blocks are shared by the
        block manager, which copies the partial last block on write)."""
        return Sequence(
            request_id=self.request_id,
            sample_index=sample_index,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            params=self.params,
            eos_token_id=self.eos_token_id,
            arrival_time=self.arrival_time,
            priority=self.priority,
            arrival_order=self.arrival_order,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            block_table=list(self.block_table),
            block_hashes=list(self.block_hashes),
            num_cached_blocks=self.num_cached_blocks,
            num_prefix_hit_tokens=self.num_prefix_hit_tokens,
            generator=generator,
            grammar=None if self.grammar is None else self.grammar.fork(self.output_token_ids),
            token_counts=None if self.token_counts is None else self.token_counts.fork(),
            lora_id=self.lora_id,
            client=self.client,
            images=self.images,
        )
