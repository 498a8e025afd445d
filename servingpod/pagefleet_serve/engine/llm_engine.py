"""The engine core's engine: token ids in, token ids out. One step = schedule -> run the
model -> update -> outputs; `add`, `abort_request`, `step` and `stats` are all a core
calls. Start-up (device policy, loading, the KV budget) is `startup.py`'s, a request's way
to the scheduler `admission.py`'s, the adapters `lora_manager.py`'s, the ranks the
executor's; text is the frontend's.

A step that fails is retried on halves of its sequences, down to single ones, so that a
request the model cannot run fails alone and the others carry on (the sampler fails its
own rows alone, without a retry). Only a step that fails for every sequence, not because
of a client's sampling settings, is the engine's own failure (`EngineFault`), which the
caller counts.
"""

import logging
import time
import weakref

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.cpu_placement import CpuPlacement
from pagefleet_serve.engine.admission import (
    Admission,
    Failure,
    grammar_stop_token_ids,
    make_grammar_compiler,
)
from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.executor.distributed import WorkerLost
from pagefleet_serve.engine.kv_events import KVEventPublisher
from pagefleet_serve.engine.kv_tier import GIB, KVTier, tier_namespace
from pagefleet_serve.engine.lora_manager import LoRAManager
from pagefleet_serve.engine.model_runner import ModelRunner, sampling_failures
from pagefleet_serve.engine.output_tracker import OutputTracker
from pagefleet_serve.engine.sampler import SampledToken, SamplingError
from pagefleet_serve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.engine.spec_decode.draft_model import DraftModelProposer
from pagefleet_serve.engine.spec_decode.speculator import Speculator
from pagefleet_serve.engine.startup import start_model
from pagefleet_serve.engine.state_checkpoints import state_cache, state_stats
from pagefleet_serve.messages import (
    EncoderStats,
    EngineStats,
    Request,
    SpecDecodeStats,
)
from pagefleet_serve.model.lora import LoRAAdapter
from pagefleet_serve.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineFault(RuntimeError):
    """The model failed for every sequence of a step, for reasons no client chose; the
    step's requests have been failed already."""


class LLMEngine:
    def __init__(
        self, config: EngineConfig, placement: CpuPlacement | None = None, tokenizer=None
    ) -> None:
        """`placement`: the CPUs of the engine's threads, which tensor-parallel ranks share
        out (see engine.executor.multiproc). `tokenizer`: the model's (the frontend loads it,
        `frontend.tokenizer.load_engine_tokenizer`), None for a model served on token ids;
        not for text: the grammar compiler reads the vocabulary from it (to make token
        masks); this is the one place constraints are compiled."""
        self.config = config
        model = start_model(config, placement)
        self.executor = model.executor
        self.model_name, self.model_config = model.name, model.config
        self.tokenizer, self.pooling = tokenizer, model.pooling
        self.max_model_len = model.max_model_len
        self.startup_seconds = model.startup_seconds
        self.device, self.dtype = self.runner.device, self.runner.dtype
        # Mean and cls pooling read every position's hidden state, which a prefix-cache
        # hit would skip: an embed engine computes every prompt whole.
        self.block_manager = BlockManager(
            model.num_blocks,
            config.block_size,
            config.enable_prefix_caching and not self.pooling,
            record_events=config.kv_events_config is not None,
            record_named=config.kv_tier_enabled,
        )
        self.state_slots, self.state_checkpoints = state_cache(
            model.num_state_slots, model.num_state_checkpoints, self.block_manager
        )
        self.kv_tier = self._kv_tier() if config.kv_tier_enabled else None
        events = config.kv_events_config
        self.kv_events = KVEventPublisher(events) if events is not None else None
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            self.max_model_len,
            self.state_slots,
            self.state_checkpoints,
            self.kv_tier,
        )
        self.speculator = None
        if config.speculative_config is not None:
            draft = self.runner.draft
            proposer = DraftModelProposer(draft, self.block_manager) if draft else None
            self.speculator = Speculator(config.speculative_config, proposer)
        self.outputs = OutputTracker()
        self._pending: list[RequestOutput] = []  # aborts, handed out by the next step
        self.grammar_stop_token_ids = grammar_stop_token_ids(self.model_config)
        self.grammar_compiler = make_grammar_compiler(tokenizer, self.model_config, config)
        if self.grammar_compiler is not None:
            # Its threads keep it (and their worker processes) alive: it ends with the
            # engine, closed or collected (an `LLM` dropped without a close).
            self._close_compiler = weakref.finalize(self, self.grammar_compiler.close)
        self.loras = LoRAManager(config, self.model_config, self.scheduler.lora_slots)
        self.admission = Admission(
            config,
            self.model_config,
            self.scheduler,
            self.loras,
            device=self.device,
            pooling=self.pooling,
            grammar_compiler=self.grammar_compiler,
        )
        for module in config.lora_modules:
            self.load_lora(module.name, module.path)
        logger.info(
            "start-up: %s",
            ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self.startup_seconds.items()),
        )

    def _kv_tier(self) -> KVTier:
        """The KV tier below the prefix cache, its blocks named for this model and shard."""
        config, runner = self.config, self.runner
        if self.state_slots is not None:
            self.executor.close()
            raise ValueError(
                f"{self.model_name} is a hybrid model (recurrent layers keep a per-sequence "
                "state), whose prefix cache the KV tier (kv_offloading_size, kv_offload_dir) "
                "does not keep yet: drop them"
            )
        namespace = tier_namespace(
            model=config.model,
            name=self.model_name,
            model_config=repr(self.model_config),
            dtype=runner.dtype,
            kv_cache_dtype=runner.kv_cache_dtype,
            block_size=config.block_size,
            quantization=config.quantization,
            activation_quantization=config.activation_quantization,
            tp=(self.executor.tp.rank, self.executor.tp.size),
            pipeline_parallel_size=config.pipeline_parallel_size,
            bytes_per_block=runner.bytes_per_block,
        )
        host_bytes = int((config.kv_offloading_size or 0) * GIB)
        dir_bytes = int(config.kv_offload_dir_max_size * GIB)
        return KVTier(namespace, config.block_size, host_bytes, config.kv_offload_dir, dir_bytes)

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner: this process's shard of the model."""
        return self.executor.runner

    def close(self) -> None:
        """End the parallel workers, the grammar compile workers and the adapter reader, if
        any (the engine cannot step after this)."""
        self.executor.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.kv_tier is not None:
            self.kv_tier.close()
        if self.grammar_compiler is not None:
            self._close_compiler()

    # -- LoRA adapters (`self.loras`; these add what the requests use) ------------------
    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Read an adapter into host memory and serve it as `name` (it reaches a device
        slot with its first request); LoRAError, see `LoRAManager.read`."""
        adapter = self.loras.read(name, path)
        self.add_lora(adapter)
        return adapter

    def add_lora(self, adapter: LoRAAdapter) -> None:
        self.loras.add(adapter, self.admission.lora_ids_in_use())

    def unload_lora(self, name: str) -> None:
        self.loras.unload(name, self.admission.users())

    # -- requests ----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request the frontend validated (engine thread only)."""
        seq = self.admission.sequence(request, self.outputs.requests)
        self.outputs.add_request(
            request.request_id, request.prompt_token_ids, request.params, request.arrival_time
        )
        if self.kv_tier is not None and seq.lora_id is None:
            self._read_ahead(seq)
        self._fail(self.admission.add(seq))

    def _read_ahead(self, seq: Sequence) -> None:
        """Have the KV tier read ahead the files of the prompt's blocks past those the
        device cache holds now."""
        self.block_manager.update_block_hashes(seq)
        hashes = seq.block_hashes[: (seq.num_tokens - 1) // self.config.block_size]
        on_device = 0
        while on_device < len(hashes) and hashes[on_device] in self.block_manager.cached:
            on_device += 1
        self.kv_tier.prefetch(seq.request_id, hashes[on_device:])

    def _fail(self, failures: list[Failure]) -> None:
        for seq, error in failures:
            self.abort_request(seq.request_id, reason="error", error=error)

    def abort_request(
        self,
        request_id: str,
        reason: str = "abort",
        error: str | None = None,
        sample_index: int | None = None,
    ) -> None:
        """End a request (or one of its samples): its blocks are freed before the next step
        and its final output is handed out by the next `step`."""
        for seq in self.scheduler.sequences_of(request_id):
            if sample_index is None or seq.sample_index == sample_index:
                self.scheduler.finish(seq, reason)
        self.admission.drop(request_id, sample_index)
        if self.kv_tier is not None and sample_index is None:
            self.kv_tier.forget(request_id)
        output = self.outputs.finish(request_id, reason, time.time(), error, sample_index)
        if output is not None:
            self._pending.append(output)

    def running_request_ids(self) -> set[str]:
        return {seq.request_id for seq in self.scheduler.running}

    def unfinished_request_ids(self) -> list[str]:
        return list(self.outputs.requests)

    def step_pending(self) -> list[RequestOutput]:
        """Hand out the outputs of aborted requests without running a step."""
        outputs, self._pending = self._pending, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self.admission.holds_any

    # -- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Raises EngineFault when the step failed for all of its sequences (their
        requests' error outputs are then handed out by `step_pending`)."""
        self._fail(self.admission.admit())
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        step = self.scheduler.schedule()
        if step.is_empty:
            self.admission.wait_for_pending()
            if self.kv_tier is not None:
                self.kv_tier.wait_for_reads(timeout=0.05)
            return self.step_pending()
        for slot, lora_id in step.lora_loads:
            self.executor.load_lora(slot, self.loras.cache.use(lora_id))
        for block_id, data in step.kv_loads:
            self.runner.write_block(block_id, data)
        now = time.time()
        for item in step.scheduled:
            self.outputs.mark_scheduled(item.seq, now)
        sampled, failed = self._execute_isolating(step.scheduled, step.state_copies)
        for request_id, exc in failed.items():
            self.abort_request(request_id, reason="error", error=f"{type(exc).__name__}: {exc}")
        succeeded = [item for item in step.scheduled if item.seq.request_id not in failed]
        for item in succeeded:
            if item.spec_token_ids:
                num_accepted = len(sampled[item.seq]) - 1
                self.speculator.record(item.seq, len(item.spec_token_ids), num_accepted)
        if not succeeded and not all(isinstance(e, SamplingError) for e in failed.values()):
            first = next(iter(failed.values()))
            raise EngineFault(
                f"the model failed for every sequence of a step: {type(first).__name__}: {first}"
            )
        new_tokens = self.scheduler.update(SchedulerOutput(succeeded, step.preempted), sampled)
        self._copy_out(self.block_manager.take_named())
        if self.kv_events is not None:
            self.kv_events.publish(self.block_manager.take_events())
        now = time.time()
        return (
            self.step_pending()
            + self._pooled(succeeded, now)
            + self.outputs.process(new_tokens, now)
        )

    def _copy_out(self, named: list[tuple[bytes, int]]) -> None:
        """Copy the blocks the step named into the KV tier (those it lacks)."""
        if self.kv_tier is None:
            return
        for block_hash, block_id in named:
            if self.kv_tier.wants(block_hash):
                self.kv_tier.store(block_hash, self.runner.read_block(block_id))

    def _pooled(self, items: list[ScheduledSeq], now: float) -> list[RequestOutput]:
        """The outputs of the embedding requests whose prompt this step completed (the
        scheduler has finished them, their blocks are free)."""
        outputs = []
        for item in items:
            seq = item.seq
            if seq.pooling and seq.is_finished:
                output = self.outputs.finish(seq.request_id, seq.finish_reason, now)
                if output is not None:
                    output.embedding = self.runner.pooler.embedding(seq)
                    outputs.append(output)
        return outputs

    def _execute_isolating(
        self, items: list[ScheduledSeq], state_copies: list[tuple[int, int]]
    ) -> tuple[dict[Sequence, list[SampledToken]], dict[str, Exception]]:
        """Run `items`; if that fails, run each half on its own, down to single sequences.
        Returns the sampled tokens of what ran and the error of each request that failed.
        A retry recomputes the same tokens into the same KV slots, so it is safe; not so a
        hybrid model's state, which the failed pass may have advanced in place: there the
        step's requests fail together."""
        try:
            sampled = self.executor.execute(SchedulerOutput(items, [], state_copies=state_copies))
            return sampled, sampling_failures(sampled)  # each failed alone, nothing re-run
        except WorkerLost:
            raise  # no retry can run: the group's collectives are broken
        except Exception as exc:  # isolated below, raised by step() if total
            if len(items) == 1 or self.state_slots is not None:
                for item in items:
                    logger.error("request %s failed a step", item.seq.request_id, exc_info=exc)
                return {}, {item.seq.request_id: exc for item in items}
        half = len(items) // 2
        sampled, failed = self._execute_isolating(items[:half], [])
        more_sampled, more_failed = self._execute_isolating(items[half:], [])
        return sampled | more_sampled, failed | more_failed

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            # Those held while their adapter is read back wait too (the autoscaler reads it).
            num_waiting=len(self.scheduler.waiting) + self.admission.num_awaiting_lora,
            num_blocks=bm.num_blocks,
            num_used_blocks=bm.num_used_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_kv_tokens=sum(seq.num_computed_tokens for seq in self.scheduler.running),
            spec_decode=self.speculator.stats() if self.speculator else SpecDecodeStats(),
            lora=self.loras.stats(self.scheduler.running, self.admission.waiting()),
            state=state_stats(
                self.state_slots, self.state_checkpoints, self.runner.state_bytes_per_slot
            ),
            kv_events_dropped=self.kv_events.num_dropped if self.kv_events else None,
            encoder=self._encoder_stats(),
            kv_tier=self.kv_tier.stats() if self.kv_tier else None,
        )

    def _encoder_stats(self) -> EncoderStats | None:
        """A vision-language model's encoder cache (rank 0's model: every rank encodes
        the same images)."""
        cache = getattr(self.runner.model, "encoder_cache", None)
        if cache is None:
            return None
        return EncoderStats(cache.queries, cache.hits, cache.seconds)
