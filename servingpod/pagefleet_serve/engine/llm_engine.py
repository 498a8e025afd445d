"""The engine core's engine: token ids in, token ids out. One step = schedule -> run the
model -> update -> outputs; `add`, `abort_request`, `step` and `stats` are all a core
calls. Device policy and the KV budget are `device.py`'s; text is the frontend's.

A step that fails is retried on halves of its sequences, down to single ones, so that a
request the model cannot run fails alone and the others carry on (the sampler fails its
own rows alone, without a retry). Only a step that fails for every sequence, not because
of a client's sampling settings, is the engine's own failure (`EngineFault`), which the
caller counts.
"""

import contextlib
import itertools
import logging
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace

import torch

from pagefleet_serve.attention import get_kernel_backend
from pagefleet_serve.config import EngineConfig, PoolingConfig
from pagefleet_serve.cpu_placement import CpuPlacement
from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.device import RunnerConfig, kv_cache_bytes
from pagefleet_serve.engine.lora_cache import LoRAHostCache
from pagefleet_serve.engine.model_runner import ModelRunner, sampling_failures
from pagefleet_serve.engine.output_tracker import OutputTracker
from pagefleet_serve.engine.parallel import WorkerLost, start_workers
from pagefleet_serve.engine.pooler import Pooler, with_head
from pagefleet_serve.engine.sampler import SampledToken, SamplingError
from pagefleet_serve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.engine.spec_decode.draft_model import DraftModelProposer, check_vocabulary
from pagefleet_serve.engine.spec_decode.speculator import Speculator
from pagefleet_serve.messages import (
    PROTOCOL_VERSION,
    CoreReady,
    EngineStats,
    LoRAAdapterInfo,
    LoRAStats,
    Request,
    RequestLimits,
    SpecDecodeStats,
)
from pagefleet_serve.model.loader import load_local, load_model
from pagefleet_serve.model.lora import (
    LoRAAdapter,
    LoRABusy,
    LoRAError,
    LoRANotFound,
    ServedLoRA,
    read_adapter,
)
from pagefleet_serve.model.pooling import read_pooling_config, resolve_task
from pagefleet_serve.model.resolve import resolve_model_uri
from pagefleet_serve.outputs import RequestOutput
from pagefleet_serve.sampling_params import SamplingParams, generator_seed, sample_seed
from pagefleet_serve.structured.grammar import GrammarCompiler, GrammarMatcher
from pagefleet_serve.structured.thinking_gate import output_constraint

logger = logging.getLogger(__name__)


class EngineFault(RuntimeError):
    """The model failed for every sequence of a step, for reasons no client chose; the
    step's requests have been failed already."""


class _Phases:
    """`with phases("name"):` adds the block's seconds to `seconds["name"]`."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds

    @contextlib.contextmanager
    def __call__(self, name: str):
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - started


class LLMEngine:
    def __init__(self, config: EngineConfig, placement: CpuPlacement | None = None) -> None:
        """`placement`: the CPUs of the engine's threads, which tensor-parallel ranks share
        out (see engine.parallel.Workers)."""
        self.config = config
        self.runner_config = RunnerConfig.of(config)
        self.device, self.dtype = self.runner_config.device, self.runner_config.dtype
        started = time.monotonic()
        # Start-up phases, in seconds: logged, and exported by the server as a gauge.
        self.startup_seconds: dict[str, float] = {}
        phase = _Phases(self.startup_seconds)
        with phase("kernel_load"):  # the C++ extensions are imported here, compiled never
            get_kernel_backend(self.runner_config.attention_backend, self.device)
        weights_started = time.monotonic()
        # Tensor parallelism: the other ranks start loading their shards meanwhile.
        self.workers, tp = start_workers(config, self.device, placement)
        try:
            # Nothing to download for a local or cached model; a sharded hf:// checkpoint's
            # shards go on downloading while the weight load reads those that have arrived.
            with phase("download"):
                local = resolve_model_uri(config.model, weights="background")
            weights_started += self.startup_seconds["download"]
            loaded = load_local(local, self.dtype, self.runner_config.weight_quantization, tp)
        except BaseException:
            self.close()
            raise
        self.model_name = loaded.name
        self.model_config = loaded.config
        # Not for text: the grammar compiler reads the vocabulary from it (to make token
        # masks), and a frontend in this process shares it.
        self.tokenizer = loaded.tokenizer
        spec = config.speculative_config
        draft = self._load_draft(spec.model) if spec is not None and spec.model else None
        try:  # a draft model is not split: it runs on rank 0
            # task embed: every request is pooled (engine/pooler.py); None: generate.
            self.pooling = self._pooling_config(local.path, loaded.config.hidden_size)
            pooler = None
            if self.pooling is not None:
                loaded, pooler = with_head(loaded), Pooler(self.pooling)
            self.runner = ModelRunner(loaded, self.runner_config, draft, pooler, tp, self.workers)
        except BaseException:
            self.close()
            raise
        del loaded
        self.startup_seconds["weight_load"] = time.monotonic() - weights_started
        logger.info(
            "model %s: %d layers, %d heads (%d kv), loaded in %.1fs",
            self.model_name,
            self.model_config.num_layers,
            self.model_config.num_heads,
            self.model_config.num_kv_heads,
            time.monotonic() - started,
        )
        logger.info("device %s, dtype %s", self.device, str(self.dtype).removeprefix("torch."))

        # With a draft model a block holds both models' K/V: the budget buys both at once.
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        kv_started = time.monotonic()
        budget = kv_cache_bytes(config, self.device, self._warm_up)
        num_blocks = budget // self.runner.bytes_per_block
        pool_tokens = num_blocks * config.block_size
        if self.max_model_len > pool_tokens:
            raise ValueError(
                f"max_model_len ({self.max_model_len} tokens) does not fit in the KV cache pool "
                f"({pool_tokens} tokens = {num_blocks} blocks of {config.block_size}); raise "
                f"kv_cache_memory_bytes or lower max_model_len"
            )
        self.runner.allocate_kv_cache(num_blocks)
        # On CUDA the warm-up ran inside kv_cache_bytes (its activation peak is measured).
        self.startup_seconds["kv_cache"] = (
            time.monotonic() - kv_started - self.startup_seconds.get("warm_up", 0.0)
        )
        logger.info(
            "KV cache pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%s), %s",
            num_blocks,
            config.block_size,
            pool_tokens,
            num_blocks * self.runner.bytes_per_block / 2**20,
            "target and draft model" if draft else "model",
            str(self.runner.kv_cache_dtype).removeprefix("torch."),
        )
        # Mean and cls pooling read every position's hidden state, which a prefix-cache
        # hit would skip: an embed engine computes every prompt whole.
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching and not self.pooling
        )
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.speculator = None
        if spec is not None:
            proposer = DraftModelProposer(draft, self.block_manager) if draft else None
            self.speculator = Speculator(spec, proposer)
        self.outputs = OutputTracker()
        self._pending: list[RequestOutput] = []  # aborts, handed out by the next step
        self.grammar_compiler = None
        if self.tokenizer is not None:
            self.grammar_compiler = GrammarCompiler(
                self.tokenizer,
                self.model_config.vocab_size,
                self.grammar_stop_token_ids,
                config.structured_outputs_compile_timeout,
            )
            # Its threads keep it (and their worker processes) alive: it ends with the
            # engine, closed or collected (an `LLM` dropped without a close).
            self._close_compiler = weakref.finalize(self, self.grammar_compiler.close)
        # Sequences whose grammar is still compiling: they join the scheduler when it is.
        self._awaiting_grammar: dict[Sequence, Future] = {}
        if self.device.type != "cuda":  # CUDA's warm-up ran before the KV cache was sized
            with phase("warm_up"):
                self.runner.warm_up_kernels(config.max_num_seqs)
        # LoRA adapters by name; the cache says which are in host memory (--max-cpu-loras),
        # the scheduler's slots which are on the device. Each load gets a new id (a
        # reloaded name shares no prefix-cache blocks); a read back keeps its id.
        self.lora_adapters: dict[str, ServedLoRA] = {}
        self._lora_ids = itertools.count(1)
        slots = self.scheduler.lora_slots
        self.lora_cache = LoRAHostCache(config.max_cpu_loras, slots) if slots is not None else None
        # Sequences whose adapter host memory dropped, waiting while it is read back (off
        # the loop, in the reader thread), and the reads in flight by lora_id.
        self._awaiting_lora: list[Sequence] = []
        self._lora_reads: dict[int, Future[LoRAAdapter]] = {}
        self._lora_reader: ThreadPoolExecutor | None = None
        for module in config.lora_modules:
            self.load_lora(module.name, module.path)
        logger.info(
            "start-up: %s",
            ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self.startup_seconds.items()),
        )

    def close(self) -> None:
        """End the parallel workers, the grammar compile workers and the adapter reader, if
        any (the engine cannot step after this); also called by a start-up that failed
        before it made them."""
        if self.workers is not None:
            self.workers.close()
        close_compiler = getattr(self, "_close_compiler", None)
        if close_compiler is not None:
            close_compiler()
        reader = getattr(self, "_lora_reader", None)
        if reader is not None:
            reader.shutdown(wait=False, cancel_futures=True)

    def _pooling_config(self, path, hidden_size: int) -> PoolingConfig | None:
        """How this engine pools when its task (auto: from the model's files) is embed."""
        if resolve_task(self.config.task, path) != "embed":
            return None
        if self.config.speculative_config is not None:
            raise ValueError(
                f"{self.config.model} is an embedding model (task embed), which never "
                "decodes: drop speculative_config"
            )
        pooling = read_pooling_config(path, hidden_size)
        logger.info(
            "task embed: %s pooling, %snormalised, %d dimensions",
            pooling.method,
            "" if pooling.normalize else "not ",
            pooling.dimensions,
        )
        return pooling

    def _load_draft(self, uri: str) -> ModelRunner:
        """The draft model's runner (speculative decoding), with the target's runner
        configuration (dtype, quantization, attention backend, KV cache dtype)."""
        config = self.runner_config
        loaded = load_model(uri, config.dtype, config.weight_quantization)
        check_vocabulary(loaded, self.model_config, self.tokenizer)
        logger.info("draft model %s: %d layers", loaded.name, loaded.config.num_layers)
        # Proposals come from the base draft: verification applies the target's adapters.
        return ModelRunner(loaded, replace(config, max_loras=0, max_lora_rank=0))

    def _warm_up(self) -> int:
        config = self.config
        with _Phases(self.startup_seconds)("warm_up"):
            return self.runner.warm_up(
                config.max_num_batched_tokens, self.max_model_len, config.max_num_seqs
            )

    # -- what a frontend is told --------------------------------------------------------
    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(
            self.max_model_len, self.model_config.vocab_size, self.config.max_num_seqs
        )

    @property
    def grammar_stop_token_ids(self) -> list[int]:
        """The tokens that end a structured output (the model's EOS ids)."""
        config = self.model_config
        return sorted({*config.eos_token_ids, config.eos_token_id} - {None})

    def ready(self) -> CoreReady:
        """What a frontend needs to know of this engine."""
        return CoreReady(
            PROTOCOL_VERSION,
            self.model_name,
            self.limits,
            self.block_manager.num_blocks,
            self.stats(),
            self.grammar_stop_token_ids,
            dict(self.startup_seconds),
            self.lora_adapter_infos(),
            self.config.enable_lora,
            self.pooling,
        )

    # -- LoRA adapters -----------------------------------------------------------------
    def lora_adapter_infos(self) -> tuple[LoRAAdapterInfo, ...]:
        return tuple(LoRAAdapterInfo(a.name, a.path) for a in self.lora_adapters.values())

    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Read an adapter into host memory and serve it as `name` (it reaches a device
        slot with its first request). LoRAError: not enabled, the name taken, or the
        adapter unreadable or unfit for this model (naming the file)."""
        adapter = self.read_lora(name, path)
        self.add_lora(adapter)
        return adapter

    def read_lora(self, name: str, path: str) -> LoRAAdapter:
        """`load_lora`'s reading and checking, which changes nothing here (any thread: a
        core reads adapters off its step loop)."""
        if not self.config.enable_lora:
            raise LoRAError("this server does not serve LoRA adapters: start it with --enable-lora")
        self._check_lora_name_free(name)
        return read_adapter(
            name, next(self._lora_ids), path, self.model_config, self.config.max_lora_rank
        )

    def add_lora(self, adapter: LoRAAdapter) -> None:
        """Serve an adapter `read_lora` read (engine thread only); with host memory full
        of adapters requests use, it is read again for its first request."""
        self._check_lora_name_free(adapter.name)
        self.lora_adapters[adapter.name] = ServedLoRA(adapter.name, adapter.lora_id, adapter.path)
        if self.lora_cache.reserve(adapter.lora_id, self._lora_ids_in_use()):
            self.lora_cache.put(adapter)
        logger.info(
            "LoRA adapter %s (rank %d) loaded from %s", adapter.name, adapter.rank, adapter.path
        )

    def _check_lora_name_free(self, name: str) -> None:
        if name in self.lora_adapters:
            raise LoRAError(f"the LoRA adapter {name!r} has already been loaded")

    def unload_lora(self, name: str) -> None:
        """Stop serving an adapter. LoRANotFound; LoRABusy while requests use it (they
        are not cut short: unload once they finish)."""
        adapter = self.lora_adapters.get(name)
        if adapter is None:
            raise LoRANotFound(f"the LoRA adapter {name!r} is not loaded")
        users = {seq.request_id for seq in self._lora_users() if seq.lora_id == adapter.lora_id}
        if users:
            raise LoRABusy(
                f"the LoRA adapter {name!r} is in use by {len(users)} requests; unload it "
                "when they have finished"
            )
        del self.lora_adapters[name]
        self.lora_cache.drop(adapter.lora_id)
        logger.info("LoRA adapter %s unloaded", name)

    def _lora_users(self) -> list[Sequence]:
        """The sequences that read, or will read, their adapter (or the base model)."""
        return [*self.scheduler.running, *self._not_running()]

    def _not_running(self) -> list[Sequence]:
        return [*self.scheduler.waiting, *self._awaiting_grammar, *self._awaiting_lora]

    def _lora_ids_in_use(self) -> set[int | None]:
        return {seq.lora_id for seq in self._lora_users()}

    def _served(self, lora_id: int) -> ServedLoRA:
        return next(a for a in self.lora_adapters.values() if a.lora_id == lora_id)

    def _admit_read_back(self) -> None:
        """Sequences whose adapter is not in host memory wait while it is read again from
        its path, once the cache has a place for it (one no request uses); they join the
        scheduler when it is in, or fail if it cannot be read."""
        if not self._awaiting_lora and not self._lora_reads:
            return
        for lora_id, future in list(self._lora_reads.items()):
            if not future.done():
                continue
            del self._lora_reads[lora_id]
            try:
                self.lora_cache.put(future.result())
            except Exception as exc:  # noqa: BLE001 - its requests fail, the step goes on
                self.lora_cache.drop(lora_id)
                for seq in [s for s in self._awaiting_lora if s.lora_id == lora_id]:
                    name = self._served(lora_id).name  # served: unload waits for its requests
                    error = f"the LoRA adapter {name!r} could not be read again: {exc}"
                    self.abort_request(seq.request_id, reason="error", error=error)
        in_use = self._lora_ids_in_use()
        waiting, self._awaiting_lora = self._awaiting_lora, []
        for seq in waiting:
            lora_id = seq.lora_id
            if lora_id in self.lora_cache:
                self._to_scheduler(seq)
                continue
            self._awaiting_lora.append(seq)
            if not self.lora_cache.is_reserved(lora_id) and self.lora_cache.reserve(
                lora_id, in_use
            ):
                served = self._served(lora_id)
                logger.info("LoRA adapter %s: read back from %s", served.name, served.path)
                if self._lora_reader is None:
                    self._lora_reader = ThreadPoolExecutor(1, thread_name_prefix="lora-reader")
                self._lora_reads[lora_id] = self._lora_reader.submit(
                    read_adapter,
                    served.name,
                    lora_id,
                    served.path,
                    self.model_config,
                    self.config.max_lora_rank,
                )

    # -- requests ----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request the frontend validated (engine thread only)."""
        if request.request_id in self.outputs.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        if request.pooling != (self.pooling is not None):
            raise ValueError(
                "this engine serves embeddings only (task embed)"
                if self.pooling is not None
                else "this engine generates text; embeddings need an embedding model (task embed)"
            )
        params = request.params

        def generator(index: int) -> torch.Generator | None:
            if params.seed is None:
                return None
            # On the device the sampler draws on (see engine/sampler.py).
            generator = torch.Generator(device=self.device)
            return generator.manual_seed(generator_seed(sample_seed(params.seed, index)))

        lora_id = None
        if request.lora_name is not None:
            adapter = self.lora_adapters.get(request.lora_name)
            if adapter is None:
                raise LoRANotFound(f"the LoRA adapter {request.lora_name!r} is not loaded")
            lora_id = adapter.lora_id
        seq = Sequence(
            request_id=request.request_id,
            sample_index=0,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            params=self._with_model_eos(params),
            eos_token_id=self.model_config.eos_token_id,
            arrival_time=request.arrival_time,
            priority=params.priority,
            generator=generator(0),
            sibling_generators=[generator(i) for i in range(1, params.n)],
            lora_id=lora_id,
            pooling=request.pooling,
            client=request.client,
        )
        self.outputs.add_request(
            request.request_id, request.prompt_token_ids, params, request.arrival_time
        )
        if params.structured_outputs is None:
            seq.grammar = output_constraint(params.thinking, None)  # a thinking budget
            self._to_scheduler(seq)
            return
        self._awaiting_grammar[seq] = self.grammar_compiler.compile_async(params.structured_outputs)
        self._admit_compiled()

    def _admit_compiled(self) -> None:
        """Hand the scheduler the sequences whose grammar has compiled (fail those whose
        grammar cannot be); the others keep waiting without holding up a step."""
        for seq, future in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[seq]
            try:
                grammar = GrammarMatcher(future.result())
            except ValueError as exc:
                self.abort_request(seq.request_id, reason="error", error=str(exc))
                continue
            # A thinking model's grammar starts where its thinking ends.
            seq.grammar = output_constraint(seq.params.thinking, grammar)
            self._to_scheduler(seq)

    def _to_scheduler(self, seq: Sequence) -> None:
        """A sequence ready to run joins the scheduler, once its adapter is in host memory."""
        if seq.lora_id is None:
            self.scheduler.add(seq)
        elif seq.lora_id in self.lora_cache:
            self.lora_cache.use(seq.lora_id)
            self.scheduler.add(seq)
        else:
            self._awaiting_lora.append(seq)

    def _wait_for_pending(self) -> None:
        """With nothing to run but sequences whose grammar is compiling or whose adapter is
        being read, wait a moment for one rather than spin through empty steps (short, so
        that new requests and aborts are still taken between steps)."""
        pending = [*self._awaiting_grammar.values(), *self._lora_reads.values()]
        if pending:
            wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)

    def _with_model_eos(self, params: SamplingParams) -> SamplingParams:
        """The model's EOS ids beyond its main one (generation_config's list) end a
        sequence as its EOS does; they ride along as stop token ids."""
        config = self.model_config
        extra = tuple(t for t in config.eos_token_ids if t != config.eos_token_id)
        if params.ignore_eos or not extra:
            return params
        return replace(params, stop_token_ids=(*params.stop_token_ids, *extra))

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
        for seq in [s for s in self._awaiting_grammar if s.request_id == request_id]:
            if sample_index is None or seq.sample_index == sample_index:
                del self._awaiting_grammar[seq]
        self._awaiting_lora = [
            s
            for s in self._awaiting_lora
            if s.request_id != request_id or sample_index not in (None, s.sample_index)
        ]
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
        return (
            self.scheduler.has_unfinished()
            or bool(self._pending)
            or bool(self._awaiting_grammar)
            or bool(self._awaiting_lora)
        )

    # -- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Raises EngineFault when the step failed for all of its sequences (their
        requests' error outputs are then handed out by `step_pending`)."""
        self._admit_compiled()
        self._admit_read_back()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        step = self.scheduler.schedule()
        if step.is_empty:
            self._wait_for_pending()
            return self.step_pending()
        for slot, lora_id in step.lora_loads:
            self.runner.load_lora(slot, self.lora_cache.use(lora_id))
        now = time.time()
        for item in step.scheduled:
            self.outputs.mark_scheduled(item.seq, now)
        sampled, failed = self._execute_isolating(step.scheduled)
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
        now = time.time()
        return (
            self.step_pending()
            + self._pooled(succeeded, now)
            + self.outputs.process(new_tokens, now)
        )

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
        self, items: list[ScheduledSeq]
    ) -> tuple[dict[Sequence, list[SampledToken]], dict[str, Exception]]:
        """Run `items`; if that fails, run each half on its own, down to single sequences.
        Returns the sampled tokens of what ran and the error of each request that failed.
        A retry recomputes the same tokens into the same KV slots, so it is safe."""
        try:
            sampled = self.runner.execute(SchedulerOutput(items, []))
            return sampled, sampling_failures(sampled)  # each failed alone, nothing re-run
        except WorkerLost:
            raise  # no retry can run: the group's collectives are broken
        except Exception as exc:  # isolated below, raised by step() if total
            if len(items) == 1:
                logger.error("request %s failed a step", items[0].seq.request_id, exc_info=exc)
                return {}, {items[0].seq.request_id: exc}
        half = len(items) // 2
        sampled, failed = self._execute_isolating(items[:half])
        more_sampled, more_failed = self._execute_isolating(items[half:])
        return sampled | more_sampled, failed | more_failed

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=bm.num_blocks,
            num_used_blocks=bm.num_used_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_kv_tokens=sum(seq.num_computed_tokens for seq in self.scheduler.running),
            spec_decode=self.speculator.stats() if self.speculator else SpecDecodeStats(),
            lora=self._lora_stats(),
        )

    def _lora_stats(self) -> LoRAStats | None:
        if not self.config.enable_lora:
            return None
        names = {a.lora_id: a.name for a in self.lora_adapters.values()}

        def named(lora_ids) -> tuple[str, ...]:
            return tuple(sorted({names[i] for i in lora_ids if i in names}))

        on_device = set(self.scheduler.lora_slots.slot_of)
        in_host_memory = () if self.config.max_cpu_loras is None else self.lora_cache.lora_ids()
        return LoRAStats(
            named(s.lora_id for s in self.scheduler.running),
            named(s.lora_id for s in self._not_running()),
            self.config.max_loras,
            on_device=named(on_device),
            in_host_memory=named(i for i in in_host_memory if i not in on_device),
        )
