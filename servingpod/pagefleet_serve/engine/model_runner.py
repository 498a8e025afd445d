"""Runs one scheduled step: builds the flattened batch, runs the model over the paged KV
cache, samples the next tokens.

A step has three parts, so that an executor can run the middle one on every copy of a
split model (`engine.executor`): `plan` turns the scheduler's step into plain lists (a
`StepBatch`) and notes which logits are sampled, `forward_batch` runs a batch (what every
shard does), `sample` pools and samples its results (what the core's runner does)."""

import itertools
from dataclasses import dataclass, field

import torch
from pagefleet_kernels.kv_cache import (
    SCALE_DTYPE,
    LayerKVCache,
    bytes_per_token_head,
    is_quantized,
    kv_cache_torch_dtype,
)
from pagefleet_kernels.state_batch import StateMetadata

from pagefleet_serve.engine.device import RunnerConfig
from pagefleet_serve.engine.pooler import Pooler
from pagefleet_serve.engine.sampler import SampledToken, SampleRow, SamplingError, sample
from pagefleet_serve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.engine.spec_verify import accepted_run, draft_rows, rewind
from pagefleet_serve.engine.step_buffers import StepBuffers, StepInputs
from pagefleet_serve.model.layers.linear_methods import can_prepack
from pagefleet_serve.model.layers.lora import LoRABatch, LoRAWeights, add_adapters
from pagefleet_serve.model.layers.state import allocate, bytes_per_sequence
from pagefleet_serve.model.loader.model_loader import LoadedModel
from pagefleet_serve.model.lora import LoRAAdapter
from pagefleet_serve.model.tensor_parallel import NO_PARALLEL, TensorParallel
from pagefleet_serve.model.vision import ImageRows, image_rows
from pagefleet_serve.outputs import TokenLogprob
from pagefleet_serve.sampling_params import SamplingParams

# The warm-up's decode batch samples with a filter on, so that the sampler's sort is in its
# peak (temperature 1, no filter, would skip it).
_WARM_UP_PARAMS = SamplingParams(top_p=0.9)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        config: RunnerConfig,
        draft: "ModelRunner | None" = None,
        pooler: Pooler | None = None,
        tp: TensorParallel = NO_PARALLEL,
        samples: bool = True,
    ) -> None:
        """`draft`: a draft model's runner (speculative decoding). Its KV cache follows
        this one over the same block ids: a block holds both models' K/V, and every batch
        this runner runs, the draft runs too, so that every computed position (prefix-cache
        blocks, recompute, chunks) holds both. `pooler`: an embed engine's, which pools the
        hidden states of its embedding sequences' rows every step. `tp`: the place of the
        shard `loaded` holds (its KV cache holds its key/value heads) and the collectives of
        its layers. `samples`: whether this runner samples its steps (the core's; in a
        pipeline the last stage's logits come to it); a worker's runs the model only."""
        device, dtype = config.device, config.dtype
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
        self.config = loaded.config
        self.model = loaded.model  # built for this rank by the loader, its weights loaded
        self.tp = tp
        self.samples = samples
        first, end = tp.kv_heads(loaded.config.num_heads, loaded.config.num_kv_heads)
        self.num_kv_heads = end - first  # this shard's (the first holds the most)
        # With no reference left in `loaded`, a weight that prepacking replaces is freed at
        # once, not held until the caller drops it.
        loaded.model = None
        self.model.to(device=device, dtype=dtype).eval()
        # A hybrid model's recurrent layers keep per-sequence state rows (in the dtypes
        # they declare once in the runner's dtype) instead of K/V, and its MLP-only layers
        # (Nemotron-H's) nothing: the KV cache holds its attention layers only.
        self.state_specs = self.model.state_specs()
        self.kv_layers = self.model.kv_layers()
        # Its stage's layers with K/V (the first stage holds the most).
        self.num_layers = len(self.kv_layers)
        if config.activation_quantization == "int8":
            self.model.use_int8_activations()
        if not config.enforce_eager:
            self.model.compile_around_attention()
        elif device.type == "cpu" and can_prepack(dtype):
            # Inductor cannot lower a prepacked weight it did not pack itself.
            self.model.prepack_linears()
        self.kv_cache: torch.Tensor | None = (
            None  # (layers, 2, blocks, block_size, kv_heads, head_dim)
        )
        self.kv_scales: torch.Tensor | None = (
            None  # (layers, 2, blocks, block_size, kv_heads), int8/fp8
        )
        # Per layer its cache: K/V views for an attention layer, state tensors by name
        # (num_state_slots, ...) for a recurrent one, None for one that keeps nothing.
        self.kv_caches: list[LayerKVCache | dict[str, torch.Tensor] | None] = []
        self.num_state_slots = 0
        self.lora: LoRAWeights | None = None
        if config.max_loras:
            if self.model.backend.add_lora is None:
                raise ValueError(
                    f"enable_lora: the {self.model.backend.name} kernel backend has no LoRA "
                    "operator; choose another --attention-backend"
                )
            self.lora = LoRAWeights(
                loaded.config, config.max_loras, config.max_lora_rank, device, dtype
            )
            self.adapters = add_adapters(self.model.layers)
        self.draft = draft
        self.pooler = pooler
        self.buffers = StepBuffers(device, config.block_size)
        # Draws for the requests that set no seed, in the order of the steps' rows: the same
        # --seed and the same requests give the same tokens (vLLM's seed). The warm-up
        # draws from torch's default generator instead, leaving this one at its seed.
        self.generator = torch.Generator(device=device).manual_seed(config.seed)

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs: this model's K/V for its tokens, and its draft's."""
        c = self.config
        per_token_head = bytes_per_token_head(self.kv_cache_dtype, c.head_dim)
        draft = self.draft.bytes_per_block if self.draft is not None else 0
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * per_token_head + draft

    @property
    def state_bytes_per_slot(self) -> int:
        """What one state slot costs: every recurrent layer's state of one sequence (0 for
        a model without recurrent layers)."""
        return sum(bytes_per_sequence(specs) for specs in self.state_specs)

    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        """`num_blocks` blocks of K/V for the attention layers, and `num_state_slots` rows
        of state for the recurrent ones (see `engine.state_slots`)."""
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks)
        c = self.config
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads)
        self.kv_cache = torch.zeros(
            *shape, c.head_dim, dtype=self.kv_cache_dtype, device=self.device
        )
        if is_quantized(self.kv_cache_dtype):
            self.kv_scales = torch.zeros(shape, dtype=SCALE_DTYPE, device=self.device)
            self.kv_caches = [
                LayerKVCache(layer[0], layer[1], scales[0], scales[1])
                for layer, scales in zip(self.kv_cache, self.kv_scales, strict=True)
            ]
        else:
            self.kv_caches = [LayerKVCache(layer[0], layer[1]) for layer in self.kv_cache]
        self.num_state_slots = num_state_slots
        paged = iter(self.kv_caches)
        kv_layers = set(self.kv_layers)
        self.kv_caches = [
            allocate(specs, num_state_slots, self.device)
            if specs
            else (next(paged) if i in kv_layers else None)
            for i, specs in enumerate(self.state_specs)
        ]

    def free_kv_cache(self) -> None:
        if self.draft is not None:
            self.draft.free_kv_cache()
        self.kv_cache, self.kv_scales, self.kv_caches = None, None, []
        self.num_state_slots = 0

    @property
    def states(self) -> list[dict[str, torch.Tensor]]:
        """The recurrent layers' state tensors, in layer order."""
        return [cache for cache in self.kv_caches if isinstance(cache, dict)]

    @torch.inference_mode()
    def warm_up(self, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> int:
        """Run the largest steps the scheduler can make, over a scratch KV cache: a prefill
        of `max_num_batched_tokens` tokens (in sequences of at most `max_model_len`) and a
        decode step of `max_num_seqs` sequences, its logits sampled. Their activation peak
        can then be measured, and their kernels are compiled before the engine is ready.
        Returns the bytes of the scratch cache (alive throughout the peak), which is freed."""
        num_seqs = min(max_num_seqs, -(-max_num_batched_tokens // max_model_len))
        lengths = [max_num_batched_tokens // num_seqs] * num_seqs
        lengths[-1] += max_num_batched_tokens - sum(lengths)
        block_counts = [-(-n // self.block_size) for n in lengths]
        self.allocate_kv_cache(sum(block_counts), max_num_seqs if self.state_bytes_per_slot else 0)
        firsts = itertools.accumulate([0, *block_counts[:-1]])
        tables = [list(range(f, f + n)) for f, n in zip(firsts, block_counts, strict=True)]
        self._warm_up_step([0] * sum(lengths), [0] * num_seqs, lengths, tables)
        # Every decode row writes its one token to the first slot: the values are not read.
        decode = [0] * max_num_seqs
        self._warm_up_step(decode, decode, [1] * max_num_seqs, [[0]] * max_num_seqs)
        scratch = sum(block_counts) * self.bytes_per_block
        scratch += self.num_state_slots * self.state_bytes_per_slot
        self.free_kv_cache()
        return scratch

    @torch.inference_mode()
    def warm_up_kernels(self, max_num_seqs: int) -> None:
        """Run each kind of step once over the allocated KV cache before the engine is
        ready, so that no request pays for a first use (a kernel's first call, oneDNN's
        primitives, the sampler's sort): a prefill chunk of two blocks, then decode steps of
        one row and of `max_num_seqs` rows, their logits sampled. Every row writes slots of
        block 0, which no sequence reads before writing them. This is the CPU's warm-up:
        CUDA's runs the largest steps to measure their activation peak, which a fixed CPU
        budget does not need, and a full-size prefill calls no kernel a two-block one does
        not, for seconds of start-up."""
        prefill = 2 * self.block_size
        self._warm_up_step([0] * prefill, [0], [prefill], [[0, 0]])
        for rows in sorted({1, max_num_seqs}):
            self._warm_up_step([0] * rows, [0] * rows, [1] * rows, [[0]] * rows)

    def _warm_up_step(self, input_ids, starts, query_lens, tables) -> None:
        lasts = [end - 1 for end in itertools.accumulate(query_lens)]
        batch = StepBatch(input_ids, starts, query_lens, tables, lasts)
        if self.num_state_slots:  # rows of a slot may repeat: their values are not read
            batch.state_slots = [i % self.num_state_slots for i in range(len(query_lens))]
            batch.state_initial = [False] * len(query_lens)
        _, logits, _ = self.forward_batch(batch)
        if self.samples:
            sample(logits, [SampleRow(_WARM_UP_PARAMS, None, [], [])] * len(query_lens))

    def load_lora(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into one of the device's slots (before a step that reads it)."""
        if self.lora is None:
            raise ValueError("this model runner has no LoRA slots (enable_lora is off)")
        self.lora.load(slot, adapter)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (src, dst) block's K/V (and scales) into dst."""
        if not copies:
            return
        src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*copies, strict=True))
        for pool in (self.kv_cache, self.kv_scales):
            if pool is not None:
                pool[:, :, dst] = pool[:, :, src]

    def read_block(self, block_id: int) -> torch.Tensor:
        """A block's K/V (then its scales, when quantized) as bytes in host memory: what
        the KV tier keeps (`write_block` puts them back)."""
        pools = [pool for pool in (self.kv_cache, self.kv_scales) if pool is not None]
        # A copy of its own, which no later step writes to.
        parts = [
            pool[:, :, block_id].clone(memory_format=torch.contiguous_format).view(-1)
            for pool in pools
        ]
        parts = [part.view(torch.uint8) for part in parts]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu()

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Put a block's bytes from `read_block` (of a runner configured alike) into a block."""
        offset = 0
        for pool in (self.kv_cache, self.kv_scales):
            if pool is None:
                continue
            target = pool[:, :, block_id]
            size = target.numel() * target.element_size()
            part = data[offset : offset + size].to(self.device).view(pool.dtype)
            target.copy_(part.view(target.shape))
            offset += size

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Each (src, dst) state slot's rows into dst, one after another: a later copy may
        read what an earlier one wrote (a checkpoint saved, then restored)."""
        for src, dst in copies:
            for state in self.states:
                for tensor in state.values():
                    tensor[dst] = tensor[src]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: list[int],
        starts: list[int],
        query_lens: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor:
        """Run the model over a flattened batch: sequence i's `query_lens[i]` tokens sit at
        positions from `starts[i]` and their K/V go to the slots its block table names.
        Returns the hidden states, one row per input token."""
        return self.run(self.buffers.build(input_ids, starts, query_lens, tables))

    @torch.inference_mode()
    def run(self, inputs: StepInputs, images: list[ImageRows] | None = None) -> torch.Tensor:
        """The model over a batch whose metadata is already on the device: this runner's
        own, or its target's (a draft runs over the target's batch as built, without the
        target's adapters). A pipeline stage takes the previous stage's output rows and
        hands its own to the next. `images`: the rows a vision-language model's images
        fill."""
        if self.lora is not None:
            self.adapters.batch = None
            if inputs.lora is not None:
                self.adapters.batch = LoRABatch(self.lora, inputs.lora, self.model.backend.add_lora)
        hidden = None
        if not self.tp.first_stage:
            num_tokens, size = inputs.input_ids.shape[0], self.config.hidden_size
            hidden = self.tp.receive_hidden(num_tokens, size, self.dtype, self.device)
        extra = {"images": images} if images else {}
        out = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn, hidden, **extra
        )
        if not self.tp.last_stage:
            self.tp.send_hidden(out)
        return out

    @torch.inference_mode()
    def plan(self, step: SchedulerOutput) -> "StepPlan":
        """The step as a `StepBatch` (what every shard runs), and which of its logits are
        sampled and which rows pooled."""
        input_ids: list[int] = []
        query_lens, starts, tables, lora_slots = [], [], [], []
        state_slots, state_initial = [], []
        images: list[ImageRows] = []
        for i, item in enumerate(step.scheduled):
            if item.seq.images:
                start, row = item.seq.num_computed_tokens, len(input_ids)
                images += image_rows(item.seq.images, i, row, start, item.num_new_tokens)
            input_ids.extend(item.input_token_ids)
            starts.append(item.seq.num_computed_tokens)
            query_lens.append(item.num_new_tokens)
            tables.append(item.seq.block_table)
            slot = item.seq.lora_slot
            lora_slots.append(-1 if slot is None else slot)
            if self.num_state_slots:
                state_slots.append(item.seq.state_slot)
                # From zeros on its first chunk (a new or recomputed prompt), else from its
                # slot: its previous chunk's, or a prefix checkpoint copied in.
                state_initial.append(item.seq.num_computed_tokens > 0)
        ends = list(itertools.accumulate(query_lens))
        sampling = _SamplePlan.of(step, ends, self.config.vocab_size, self.device)
        batch = StepBatch(
            input_ids,
            starts,
            query_lens,
            tables,
            sampling.logits_rows,
            sampling.sample_rows,
            lora_slots if self.lora is not None else [],
            step.block_copies,
            state_slots,
            state_initial,
            step.state_copies,
            images,
        )
        return StepPlan(batch, step.scheduled, ends, sampling)

    @torch.inference_mode()
    def sample(
        self,
        plan: "StepPlan",
        hidden: torch.Tensor,
        logits: torch.Tensor | None,
        inputs: StepInputs,
    ) -> dict[Sequence, list[SampledToken]]:
        """The planned step's outputs from what `forward_batch` returned: its embedding
        sequences' rows pooled, its next tokens sampled."""
        if self.pooler is not None:
            self.pooler.accumulate(plan.scheduled, hidden, plan.ends)
        return self._sample(plan.sampling, logits, inputs)

    @torch.inference_mode()
    def forward_batch(
        self, batch: "StepBatch"
    ) -> tuple[torch.Tensor, torch.Tensor | None, StepInputs]:
        """One step's model work, the same on every shard: its block copies, the model (and
        the draft) over its batch, and the logits of its `logits_rows` (a pipeline's last
        stage computes them, the runner that samples receives them). Returns the hidden
        states (the stage's), the logits (None when it has no such rows, and where this
        runner does not sample) and the device-side inputs."""
        inputs = self.buffers.build(
            batch.input_ids,
            batch.starts,
            batch.query_lens,
            batch.tables,
            batch.logits_rows,
            batch.sample_rows,
            batch.lora_slots,
        )
        self.copy_blocks(batch.block_copies)
        if batch.state_slots:
            self.copy_states(batch.state_copies)
            inputs.attn.state = StateMetadata(
                inputs.attn.query_start_loc,
                batch.query_lens,
                torch.tensor(batch.state_slots, dtype=torch.int64, device=self.device),
                torch.tensor(batch.state_initial, dtype=torch.bool, device=self.device),
            )
        hidden = self.run(inputs, batch.images)
        if self.draft is not None:
            self.draft.copy_blocks(batch.block_copies)
            self.draft.run(inputs)
        logits = None
        if batch.logits_rows and self.tp.last_stage:
            rows = hidden.index_select(0, inputs.logits_rows)
            logits = self.tp.send_logits(self.model.compute_logits(rows))
        elif batch.logits_rows and self.samples:
            rows, vocab = len(batch.logits_rows), self.config.vocab_size
            logits = self.tp.receive_logits(rows, vocab, self.device)
        return hidden, logits, inputs

    def _sample(
        self, plan: "_SamplePlan", logits: torch.Tensor | None, inputs: StepInputs
    ) -> dict[Sequence, list[SampledToken]]:
        for scoring in plan.prompt_scoring:
            scoring.score(logits)
        if not plan.sampling:
            return {}
        seeded = {
            item.seq: item.seq.generator.get_state()
            for item in plan.sampling
            if item.spec_token_ids and item.seq.generator is not None and not item.seq.params.greedy
        }
        if plan.sample_rows:  # n > 1: a row per sample
            logits = logits.index_select(0, inputs.sample_rows)
        tokens = sample(logits, plan.rows, self.generator)
        result, k = {}, 0
        for item in plan.sampling:
            seq, drafts = item.seq, item.spec_token_ids
            num_rows = len(drafts) + 1 if drafts else seq.num_samples
            result[seq] = tokens[k : k + num_rows]
            k += num_rows
            if drafts:
                result[seq] = accepted_run(result[seq], drafts)
                if seq in seeded and len(result[seq]) < num_rows:
                    rewind(seq.generator, seeded[seq], len(result[seq]))
        return result


def sampling_failures(sampled: dict[Sequence, list[SampledToken]]) -> dict[str, SamplingError]:
    """The requests of a step's results whose rows could not be sampled, with why: they fail
    alone, and nothing of the step is run again."""
    return {
        seq.request_id: SamplingError(token.error)
        for seq, tokens in sampled.items()
        for token in tokens
        if token.error is not None
    }


@dataclass
class StepBatch:
    """A step's batch as plain lists (see `StepBuffers.build`), what an executor hands every
    shard of the model, and its copy-on-write block copies."""

    input_ids: list[int]
    starts: list[int]
    query_lens: list[int]
    tables: list[list[int]]
    logits_rows: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)  # empty: no adapters
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # A hybrid model's: each sequence's state slot and whether it continues from it, and
    # the slot copies made before the step (empty: the model keeps no state).
    state_slots: list[int] = field(default_factory=list)
    state_initial: list[bool] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # A vision-language model's: the rows its images' embeddings fill.
    images: list[ImageRows] = field(default_factory=list)


@dataclass
class StepPlan:
    """A step as `ModelRunner.plan` made it: the batch, and for `ModelRunner.sample` the
    step's items with the end of each one's rows, and what it samples."""

    batch: StepBatch
    scheduled: list[ScheduledSeq]
    ends: list[int]
    sampling: "_SamplePlan"


@dataclass
class _PromptScoring:
    """A prefill chunk of a sequence that asked for prompt logprobs: the logits rows of its
    positions `first` .. `first + num_rows - 1`, each scoring the prompt token after it."""

    seq: Sequence
    first: int
    rows: list[int]  # into the step's logits

    def score(self, logits: torch.Tensor) -> None:
        seq, k = self.seq, self.seq.params.prompt_logprobs or 0
        logprobs = torch.log_softmax(logits[_on_device(logits, self.rows)], dim=-1)
        targets = seq.token_ids[self.first + 1 : self.first + 1 + len(self.rows)]
        chosen = logprobs.gather(1, _on_device(logits, targets)[:, None])[:, 0]
        values, indices = logprobs.topk(k, dim=-1)
        # One device-to-host copy: float64 holds every token id and float32 logprob.
        packed = torch.cat([chosen, values.flatten(), indices.flatten()]).double().tolist()
        num = len(targets)
        top_values, top_ids = packed[num : num + num * k], packed[num + num * k :]
        del seq.prompt_logprobs[self.first :]
        seq.prompt_logprobs.extend(
            TokenLogprob(
                token_id,
                packed[i],
                [
                    (int(t), v)
                    for t, v in zip(
                        top_ids[i * k : i * k + k], top_values[i * k : i * k + k], strict=True
                    )
                ],
            )
            for i, token_id in enumerate(targets)
        )


def _on_device(like: torch.Tensor, values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


@dataclass
class _SamplePlan:
    """Which logits a step samples, known before its forward pass so that the row indices
    go to the device with the rest of the step's metadata."""

    sampling: list[ScheduledSeq]  # the items that sample, in order
    rows: list[SampleRow]  # one per draw
    logits_rows: list[int]  # the hidden rows whose logits are computed
    sample_rows: list[int]  # the logits row of each draw; empty when one draw per row
    prompt_scoring: list[_PromptScoring] = field(default_factory=list)

    @classmethod
    def of(
        cls, step: SchedulerOutput, ends: list[int], vocab: int, device: torch.device
    ) -> "_SamplePlan":
        """Logits of each sampling sequence's last position, or of its last 1 + k positions
        when it verifies k drafts; one sample row per position and per sample (the samples
        of one prompt share its penalty counts)."""
        sampling, scored, rows, row_logits, prompt_scoring = [], [], [], [], []
        for end, item in zip(ends, step.scheduled, strict=True):
            seq, drafts = item.seq, item.spec_token_ids
            first = seq.num_computed_tokens
            # Positions of this chunk whose next token is a prompt token: the last prompt
            # position's logits are the first output token's, sampled below.
            last = min(first + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if seq.params.prompt_logprobs is not None and first < last:
                start = end - item.num_new_tokens
                positions = range(start, start + last - first)
                prompt_scoring.append(
                    _PromptScoring(
                        seq, first, list(range(len(scored), len(scored) + len(positions)))
                    )
                )
                scored.extend(positions)
            if not item.samples:
                continue
            sampling.append(item)
            if drafts:
                row_logits.extend(range(len(scored), len(scored) + len(drafts) + 1))
                scored.extend(range(end - len(drafts) - 1, end))
                rows.extend(draft_rows(seq, drafts))
                continue
            counts = seq.penalty_counts(vocab, device)
            banned = seq.banned_token_ids()
            for generator in [seq.generator, *seq.sibling_generators]:
                rows.append(SampleRow(seq.params, generator, [], [], seq.grammar, counts, banned))
                row_logits.append(len(scored))
            scored.append(end - 1)
        one_per_row = row_logits == list(range(len(scored)))
        return cls(sampling, rows, scored, [] if one_per_row else row_logits, prompt_scoring)
