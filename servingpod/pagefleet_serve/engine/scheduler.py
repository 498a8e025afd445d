"""Iteration-level scheduling: every step decides which sequences run and how many tokens
each computes, under `max_num_seqs` and a token budget (`max_num_batched_tokens`).

One rule (as in vLLM v1): a sequence's `num_computed_tokens` catches up with its
`num_tokens`. Running decodes go first, so a long prompt (prefilled in chunks) never
starves them; then ongoing prefills; then waiting requests by priority, then the client
holding the fewest of the batch's seats, then arrival (`_next_waiting`); a full batch gives
seats to a client below its fair share (`_find_seats`). While requests wait, an ongoing
prefill's chunk takes at most half (rounded up) of the budget left after the decodes, so
a long prompt does not hold every new request back until its whole prefill is done (each
of its chunks can take seconds on a CPU); when no waiting request could be admitted, the
chunk takes the rest back.
When blocks run out the newest running sequence is preempted: its blocks are freed and it
is recomputed later (its full blocks usually survive in the prefix cache).

Speculative decoding rides on the same rule: a decoding sequence's draft tokens are
scheduled as extra query tokens within the budget, and `update` counts as computed only
the drafts the model accepted, handing back the blocks of the rejected ones. A draft model
writes its next proposals' K/V before the step that verifies them, so with one a sequence
reaching its end also keeps `num_lookahead_tokens` slots allocated past it (as vLLM does).

A running sequence with a LoRA adapter holds one of the `max_loras` adapter slots
(`LoRASlots`); a waiting request whose adapter finds none free stays waiting while the
requests behind it are admitted, so the step's rows never read more adapters than there
are slots.

A hybrid model's running sequence also holds a state slot (`StateSlots`): a waiting request
finding none free for it and its n samples stays waiting, as for blocks. Its prefix-cache
hits go as deep as a state checkpoint (`StateCheckpoints`), and a prompt's chunk ends at
the block boundary a repeat of it would resume from, so that its state there is kept.

With a KV tier (`KVTier`), a waiting request's prefix that misses the device cache is
looked up there next (once the blocks only its files hold have been read ahead: until
then the request is passed over): the blocks it holds, from the first the device lacks on, are
admitted as computed, in fresh blocks their bytes are loaded into before the step (the
step's `kv_loads`), and count as prefix-cache hits.

An embedding request (`Sequence.pooling`) follows the same rule up to the end of its
prompt, in chunks batched with other prefills; it never samples, and the step that
completes its prompt finishes it, freeing its blocks (the engine hands out its vector).
"""

import bisect
import collections
from dataclasses import dataclass, field

import torch

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.kv_tier import KVTier
from pagefleet_serve.engine.lora_slots import LoRASlots
from pagefleet_serve.engine.sampler import SampledToken
from pagefleet_serve.engine.sequence import Sequence, SequenceStatus
from pagefleet_serve.engine.state_checkpoints import StateCheckpoints
from pagefleet_serve.engine.state_slots import StateSlots


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified this step
    # (block id, bytes): the KV tier's blocks to load into the sequence's blocks first.
    kv_loads: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence's tokens (and so samples)."""
        if self.seq.pooling:
            return False
        end = self.seq.num_tokens + len(self.spec_token_ids)
        return self.seq.num_computed_tokens + self.num_new_tokens == end

    @property
    def input_token_ids(self) -> list[int]:
        start = self.seq.num_computed_tokens
        if self.spec_token_ids:  # a decode: its last token, then the drafts
            return self.seq.token_ids[start:] + self.spec_token_ids
        return self.seq.token_ids[start : start + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    # (slot, lora_id): adapters to copy into their slots before the step runs.
    lora_loads: list[tuple[int, int]] = field(default_factory=list)
    # (src, dst): state slots to copy, in order, before the step runs (a hybrid model's).
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        return [copy for item in self.scheduled for copy in item.block_copies]

    @property
    def kv_loads(self) -> list[tuple[int, torch.Tensor]]:
        return [load for item in self.scheduled for load in item.kv_loads]

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        state_slots: StateSlots | None = None,
        checkpoints: StateCheckpoints | None = None,
        tier: KVTier | None = None,
    ):
        """`state_slots`: a hybrid model's (None: the model keeps no per-sequence state);
        `checkpoints`: its prefix cache's states (None: prefix caching is off); `tier`:
        the KV tier below the prefix cache (None: none)."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        spec = config.speculative_config
        self.num_lookahead_tokens = (
            spec.num_speculative_tokens if spec is not None and spec.method == "draft_model" else 0
        )
        self.lora_slots = LoRASlots(config.max_loras) if config.enable_lora else None
        self.state_slots = state_slots
        self.checkpoints = checkpoints
        self.tier = tier
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self._waiting_clients: collections.Counter[str] = collections.Counter()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- bookkeeping ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)
        self._waiting_clients[seq.client] += 1

    def _leave_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self._waiting_clients[seq.client] -= 1
        if not self._waiting_clients[seq.client]:
            del self._waiting_clients[seq.client]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (abort, or a stop string seen by the output side)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self._leave_waiting(seq)
        self.block_manager.free(seq)
        self._release_lora(seq)
        self._release_state(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def sequences_of(self, request_id: str) -> list[Sequence]:
        return [s for s in self.running + self.waiting if s.request_id == request_id]

    # -- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, ScheduledSeq] = {}
        preempted: list[Sequence] = []
        halved: list[Sequence] = []  # prefill chunks that left half the budget to the waiting
        decodes_first = sorted(
            self.running, key=lambda s: (s.num_computed_tokens < s.num_prompt_tokens, s.sort_key)
        )
        for seq in decodes_first:
            if budget <= 0:  # an image's chunk may pass it
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            drafts = self._drafts(seq, budget)
            halve = bool(self.waiting) and seq.num_computed_tokens < seq.num_prompt_tokens
            limit = (budget + 1) // 2 if halve else budget
            num_new = min(seq.num_tokens - seq.num_computed_tokens, limit) + len(drafts)
            num_new = self._to_checkpoint(seq, seq.num_computed_tokens, num_new)
            lookahead = self._lookahead(seq, seq.num_computed_tokens + num_new)
            while (copies := self.block_manager.allocate(seq, num_new + lookahead)) is None:
                if drafts or lookahead:  # drop the speculation before preempting anyone for it
                    num_new -= len(drafts)
                    drafts, lookahead = [], 0
                    continue
                victim = max(self.running, key=lambda s: s.sort_key)
                if victim in scheduled:
                    budget += scheduled.pop(victim).num_new_tokens
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if copies is None:
                continue
            scheduled[seq] = ScheduledSeq(seq, num_new, copies, drafts)
            budget -= num_new
            if halve and seq.num_computed_tokens + num_new < seq.num_tokens:
                halved.append(seq)

        # Admit waiting requests, unless this step had to preempt (no room to grow); one
        # whose adapter finds no free slot waits, and those behind it are considered.
        out_of_blocks = bool(preempted)
        admitted = False
        passed_over: set[Sequence] = set()
        held = self._seats_held()  # kept up to date below, not recounted per admission
        while budget > 0 and not out_of_blocks and self.waiting:
            seq = self._next_waiting(passed_over, held)
            if seq is None:
                break
            if self.tier is not None and not self.tier.ready(seq.request_id):
                passed_over.add(seq)  # its blocks are still being read ahead
                continue
            freed = self._find_seats(seq, scheduled, preempted, held)
            if freed is None:
                break
            budget += freed
            if seq.lora_id is not None and not self.lora_slots.can_acquire(seq.lora_id):
                passed_over.add(seq)
                continue
            if self.state_slots is not None and not self.state_slots.can_hold(seq):
                break
            # Prompt logprobs need every prompt position's logits: no cached prefix.
            wants_prompt = seq.params.prompt_logprobs is not None
            prefix = [] if wants_prompt else self.block_manager.find_cached_prefix(seq)
            if self.checkpoints is not None:
                prefix = prefix[: self.checkpoints.resumable(seq, len(prefix))]
            loaded = [] if wants_prompt else self._from_tier(seq, len(prefix))
            start = (len(prefix) + len(loaded)) * self.block_manager.block_size
            num_new = self._to_checkpoint(seq, start, min(seq.num_tokens - start, budget))
            lookahead = self._lookahead(seq, start + num_new)
            copies = self.block_manager.allocate(seq, num_new + lookahead, prefix, len(loaded))
            if copies is None and lookahead:
                copies = self.block_manager.allocate(seq, num_new, prefix, len(loaded))
            if copies is None:
                break
            if self.tier is not None and not wants_prompt and seq.lora_id is None:
                self.tier.count(
                    seq.num_tokens - len(prefix) * self.block_manager.block_size, loaded
                )
            num_hit = seq.num_computed_tokens
            self.block_manager.count_prefix_lookup(seq.num_tokens, num_hit)
            if seq.num_preemptions == 0:
                seq.num_prefix_hit_tokens = num_hit
            self._leave_waiting(seq)
            self._acquire_lora(seq)
            if self.state_slots is not None:
                self.state_slots.acquire(seq)
            if self.checkpoints is not None and prefix:
                self.checkpoints.restore(seq, len(prefix))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            held[seq.client] += seq.num_samples
            table = seq.block_table[len(prefix) : len(prefix) + len(loaded)]
            kv_loads = [(block_id, data) for block_id, (data, _) in zip(table, loaded, strict=True)]
            scheduled[seq] = ScheduledSeq(seq, num_new, copies, kv_loads=kv_loads)
            budget -= num_new
            admitted = True

        if not admitted:  # nobody could use the half left: the prefills take it back
            for seq in halved:
                budget -= self._extend(scheduled, seq, budget)

        loads = self.lora_slots.take_loads() if self.lora_slots is not None else []
        copies = self.state_slots.take_copies() if self.state_slots is not None else []
        return SchedulerOutput(list(scheduled.values()), preempted, loads, copies)

    def _extend(self, scheduled: dict[Sequence, ScheduledSeq], seq: Sequence, budget: int) -> int:
        """Give a scheduled prefill chunk up to `budget` more of its prompt's tokens (as
        many as the free blocks allow); returns how many it took."""
        item = scheduled.get(seq)
        if item is None or budget <= 0 or seq.status is not SequenceStatus.RUNNING:
            return 0
        total = min(item.num_new_tokens + budget, seq.num_tokens - seq.num_computed_tokens)
        total = self._to_checkpoint(seq, seq.num_computed_tokens, total)
        copies = self.block_manager.allocate(
            seq, total + self._lookahead(seq, seq.num_computed_tokens + total)
        )
        if copies is None:
            return 0
        more = total - item.num_new_tokens
        scheduled[seq] = ScheduledSeq(
            seq, total, item.block_copies + copies, kv_loads=item.kv_loads
        )
        return more

    def _from_tier(self, seq: Sequence, num_cached: int) -> list[tuple[torch.Tensor, str]]:
        """The KV tier's blocks of the sequence's prefix past its `num_cached` device hits
        (bytes, medium), up to the last full block before its last token (whose logits the
        step needs)."""
        if self.tier is None or seq.lora_id is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_manager.block_size
        return self.tier.fetch(seq.block_hashes[num_cached:max_blocks])

    def _to_checkpoint(self, seq: Sequence, start: int, num_new: int) -> int:
        """A hybrid prompt's chunk from `start` ends at the boundary a repeat of the prompt
        resumes from, where its state is checkpointed (see `StateCheckpoints`); and no
        chunk ends inside an image, whose tokens attend to each other both ways: it ends
        before the image, or, starting in it, takes the rest of it (past the budget by
        less than an image)."""
        end = start + num_new
        for image in seq.images:
            image_end = image.offset + image.length
            if image.offset < end < image_end:
                end = image.offset if image.offset > start else image_end
        num_new = end - start
        if self.checkpoints is None:
            return num_new
        boundary = self.checkpoints.boundary(seq)
        return boundary - start if start < boundary < start + num_new else num_new

    # -- fairness between clients ----------------------------------------------------------
    def _seats_held(self) -> collections.Counter[str]:
        """Seats of the batch (`max_num_seqs`) each client's running sequences hold (a
        prompt that has not forked yet holds its n)."""
        held: collections.Counter[str] = collections.Counter()
        for seq in self.running:
            held[seq.client] += seq.num_samples
        return held

    def _next_waiting(
        self, passed_over: set[Sequence], held: collections.Counter[str]
    ) -> Sequence | None:
        """The waiting sequence to admit next: by priority, then the client holding the
        fewest seats (`held`), then arrival. With one client (offline, or every request
        from one address) this is (priority, arrival) order.

        `waiting` is in (priority, arrival) order, so only each client's first sequence
        at the best priority can win: the scan stops once it has seen every waiting
        client there, or found one that holds no seat (one client: the first sequence)."""
        best: Sequence | None = None
        best_key: tuple[int, int, int] | None = None
        seen: set[str] = set()
        for seq in self.waiting:
            if best is not None and seq.priority > best.priority:
                break
            if seq in passed_over or seq.client in seen:
                continue
            seen.add(seq.client)
            key = (seq.priority, held[seq.client], seq.arrival_order)
            if best_key is None or key < best_key:
                best, best_key = seq, key
            if held[seq.client] == 0 and best is seq:
                break
            if len(seen) >= len(self._waiting_clients):
                break
        return best

    def _find_seats(
        self,
        seq: Sequence,
        scheduled: dict[Sequence, ScheduledSeq],
        preempted: list[Sequence],
        held: collections.Counter[str],
    ) -> int | None:
        """Make room for `seq`'s seats this step: returns the tokens of this step's budget
        given back by the sequences preempted for it, or None when it must wait.

        When the batch is full, a client below its fair share (`max_num_seqs` over the
        clients running, it included) takes seats from the client holding the most, above
        its share: that client's newest sequences of no better priority are preempted
        (recomputed later, as for blocks). So one client's n=64 requests cannot keep
        everyone else waiting in arrival order, and a request that would take more than
        its client's share waits for free seats."""
        seats = sum(held.values())
        if seats + seq.num_samples <= self.max_num_seqs:
            return 0
        share = self.max_num_seqs // len(held.keys() | {seq.client})
        if held[seq.client] + seq.num_samples > share:
            return None
        planned = held.copy()
        plan: list[Sequence] = []  # chosen before any is preempted: all or none
        while seats + seq.num_samples > self.max_num_seqs:
            top, most = max(planned.items(), key=lambda item: item[1])
            if top == seq.client or most <= share:
                return None
            victims = [
                s
                for s in self.running
                if s.client == top and s.priority >= seq.priority and s not in plan
            ]
            if not victims:
                return None
            victim = max(victims, key=lambda s: (s.sort_key, s.sample_index))
            plan.append(victim)
            planned[top] -= victim.num_samples
            seats -= victim.num_samples
        freed = 0
        for victim in plan:
            if victim in scheduled:
                freed += scheduled.pop(victim).num_new_tokens
            self._preempt(victim)
            preempted.append(victim)
            held[victim.client] -= victim.num_samples
            if not held[victim.client]:
                del held[victim.client]
        return freed

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The proposed drafts a decoding sequence verifies this step: as many as fit the
        token budget, and that could all be accepted (plus the bonus token) within
        max_tokens and the context length."""
        if seq.num_computed_tokens != seq.num_tokens - 1 or seq.sibling_generators:
            return []
        room = min(
            budget - 1,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        return seq.spec_token_ids[: max(room, 0)]

    def _lookahead(self, seq: Sequence, num_computed_after: int) -> int:
        """The slots past a sequence's tokens to allocate for a draft model's proposals:
        when this step reaches its end and it may speculate next."""
        if num_computed_after < seq.num_tokens or seq.sibling_generators:
            return 0
        return self.num_lookahead_tokens

    def _acquire_lora(self, seq: Sequence) -> None:
        """A sequence starts running: it reads its adapter's slot (known to be free or
        its adapter's already: `can_acquire`, or a sibling's)."""
        if seq.lora_id is not None:
            seq.lora_slot = self.lora_slots.acquire(seq.lora_id)

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot is not None:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = None

    def _release_state(self, seq: Sequence) -> None:
        if self.state_slots is not None:
            self.state_slots.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._release_lora(seq)
        self._release_state(seq)
        seq.num_computed_tokens = 0
        seq.pooled_chunks.clear()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def update(
        self, output: SchedulerOutput, sampled: dict[Sequence, list[SampledToken]]
    ) -> list[tuple[Sequence, SampledToken]]:
        """Advance the scheduled sequences by the step's results.

        `sampled[seq]` holds one token; or the accepted drafts plus one token when the
        step verified drafts; or `num_samples` tokens for a request's first sequence whose
        prompt just completed (it forks into its siblings here).
        Returns (sequence, new token) pairs, siblings included, in order.
        """
        new_tokens = []
        for item in output.scheduled:
            seq = item.seq
            # Drafts count as computed only once accepted (`_append_run`).
            seq.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids)
            self.block_manager.cache_full_blocks(seq)
            if self.checkpoints is not None:
                self.checkpoints.save(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
            if seq.pooling:  # prefilled and pooled: done, its KV is not kept
                self.finish(seq, "stop")
                continue
            if seq.sibling_generators:
                new_tokens += self._fork(seq, sampled[seq])
            else:
                new_tokens += self._append_run(seq, sampled[seq], item.spec_token_ids)
        return new_tokens

    def _append_run(
        self, seq: Sequence, tokens: list[SampledToken], drafts: list[int]
    ) -> list[tuple[Sequence, SampledToken]]:
        """Append the step's tokens until one ends the sequence. The accepted drafts' KV
        becomes computed; the rejected ones' slots lie past num_computed_tokens, where the
        next step overwrites them, and the blocks holding only those go back."""
        appended = []
        for token in tokens:
            appended.append((seq, token))
            if self._append(seq, token):
                break
        if drafts and not seq.is_finished:
            seq.num_computed_tokens += len(appended) - 1
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.trim(seq, self.num_lookahead_tokens)
        return appended

    def _fork(
        self, seq: Sequence, tokens: list[SampledToken]
    ) -> list[tuple[Sequence, SampledToken]]:
        """A request's prompt is done: its first sequence forks into its n samples."""
        new_tokens = []
        family = [seq]
        for index, generator in enumerate(seq.sibling_generators, start=1):
            child = seq.fork(index, generator)
            self.block_manager.fork(child)
            if self.state_slots is not None:
                self.state_slots.fork(seq, child)
            self._acquire_lora(child)
            self.running.append(child)
            family.append(child)
        seq.sibling_generators = []
        for member, token in zip(family, tokens, strict=True):
            new_tokens.append((member, token))
            self._append(member, token)
        return new_tokens

    def _append(self, seq: Sequence, token: SampledToken) -> bool:
        """One sampled token joins the sequence (and advances its grammar); True when it
        ends the sequence, which is then finished."""
        seq.token_ids.append(token.token_id)
        if seq.grammar is not None:
            seq.grammar.accept(token.token_id)
        reason = self._stop_reason(seq, token.token_id)
        if reason is not None:
            self.finish(seq, reason)
        return reason is not None

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        # A constrained sequence ends when its grammar does, whatever ignore_eos says: past
        # that point nothing masks its rows, and free text would follow the constraint.
        if seq.grammar is not None and seq.grammar.is_terminated:
            return "stop"
        if not params.ignore_eos and token == seq.eos_token_id:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None
