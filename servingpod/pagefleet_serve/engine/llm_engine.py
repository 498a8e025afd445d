"""The engine: one step = schedule -> run the model -> update -> outputs.

A step that fails is retried on halves of its sequences, down to single ones, so that a
request the model or the sampler cannot run fails alone and the others carry on. Only a
step that fails for every sequence, not because of a client's sampling settings, is the
engine's own failure (`EngineFault`), which the caller counts.
"""

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.model_runner import ModelRunner
from pagefleet_serve.engine.sampler import SampledToken, SamplingError
from pagefleet_serve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.engine.spec_decode.draft_model import DraftModelProposer, check_vocabulary
from pagefleet_serve.engine.spec_decode.speculator import SpecDecodeStats, Speculator
from pagefleet_serve.model.loader import load_model
from pagefleet_serve.output_processor import OutputProcessor
from pagefleet_serve.outputs import RequestOutput
from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.structured.grammar import GrammarCompiler, GrammarMatcher

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class Request:
    """A validated request, ready for the engine thread."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against; the frontend gets them from the core."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int


def prompt_token_ids(prompt: str | list[int], tokenizer, model_name: str) -> list[int]:
    """A prompt as token ids (text is tokenized without special tokens). ValueError."""
    if not isinstance(prompt, str):
        return prompt
    if not prompt:
        raise ValueError("prompt must not be empty")
    if tokenizer is None:
        raise ValueError(f"model {model_name} has no tokenizer: pass token ids")
    return tokenizer.encode(prompt, add_special_tokens=False)


def validate_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    limits: RequestLimits,
    grammar_compiler: GrammarCompiler | None,
    arrival_time: float | None = None,
    wait_for_grammar: bool = True,
) -> Request:
    """The one check of a request before it is queued (the core trusts it). Raises
    ValueError (ContextLengthError when it does not fit the context). A structured output's
    constraint is compiled here, and the caller waits: a bad one raises (a 400), and the
    compiled grammar is cached for the engine (`grammar_compiler` None: no tokenizer, so
    no constraint can be compiled). With `wait_for_grammar` false the compile is only
    started, and the caller awaits its future before queueing the request."""
    prompt_token_ids = list(prompt_token_ids)
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    if len(prompt_token_ids) + params.max_tokens > limits.max_model_len:  # cheap: first
        raise ContextLengthError(limits.max_model_len, len(prompt_token_ids), params.max_tokens)
    vocab = limits.vocab_size
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    if params.n > limits.max_num_seqs:
        raise ValueError(f"n must be at most max_num_seqs ({limits.max_num_seqs})")
    constraint = params.structured_outputs
    if constraint is not None:
        if grammar_compiler is None:
            raise ValueError(f"{constraint.field}: this model has no tokenizer to compile it with")
        compiling = grammar_compiler.compile_async(constraint)
        if wait_for_grammar:
            compiling.result()
    return Request(request_id, prompt_token_ids, params, arrival_time or time.time())


class ContextLengthError(ValueError):
    """The prompt plus max_tokens does not fit the model's context; carries the numbers so
    the API can word the error its own way."""

    def __init__(self, max_model_len: int, num_prompt_tokens: int, max_tokens: int) -> None:
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        super().__init__(
            f"prompt: this model's maximum context length is {max_model_len} tokens, "
            f"but {num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for max_tokens)"
        )


class EngineFault(RuntimeError):
    """The model failed for every sequence of a step, for reasons no client chose; the
    step's requests have been failed already."""


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_used_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_kv_tokens: int  # tokens whose K/V the running sequences hold in their blocks
    spec_decode: SpecDecodeStats = SpecDecodeStats()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    return device


def make_current(device: torch.device) -> None:
    """Make `cuda:N` the current CUDA device: Triton launches its kernels on the current
    device, not on their tensors', and torch.cuda calls without a device read it too."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX-BF16 or AVX512-BF16), read
    from the Linux CPU flags; elsewhere bfloat16 is emulated and slower than float32."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bfloat16 (as vLLM's CPU backend
    does), float32 on other CPUs."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


def weight_quantization(config: EngineConfig, device: torch.device) -> str:
    """The quantization the loader applies: the packed weight-only kernels are CPU ones, so
    on CUDA `auto` expands (int8 is refused)."""
    if device.type == "cpu" or config.quantization == "none":
        return config.quantization
    if config.quantization == "int8":
        raise ValueError(f"quantization 'int8' runs on the CPU only, got device {device}")
    return "none"


def activation_quantization(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The activation rounding of 4-bit matmuls: int8 is computed for float32 activations
    on the CPU (its integer dot products are the C++ CPU kernel's), and refused elsewhere."""
    if config.activation_quantization == "none":
        return "none"
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"activation_quantization {config.activation_quantization!r} runs on the CPU with "
            f"float32 activations (dtype float32), got device {device}, dtype "
            f"{str(dtype).removeprefix('torch.')}"
        )
    return config.activation_quantization


class DeviceMemory(Protocol):
    """What the KV budget reads of a device's memory (a fake one in tests)."""

    def reset_peak(self) -> None: ...
    def mem_get_info(self) -> tuple[int, int]: ...  # free, total bytes of the device
    def allocated(self) -> int: ...  # bytes torch holds now
    def peak_allocated(self) -> int: ...  # the most it held since reset_peak


@dataclass(frozen=True)
class CudaMemory:
    device: torch.device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        torch.cuda.empty_cache()  # what the warm-up freed is free for the KV cache
        return torch.cuda.mem_get_info(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


def kv_cache_budget(memory: DeviceMemory, utilization: float, warm_up: Callable[[], int]) -> int:
    """Bytes for the KV cache: `utilization` of the device, less what is in use after
    `warm_up` (the weights, the CUDA context, compiled kernels) and less its activation
    peak, held in reserve for the largest steps. `warm_up` runs them over a scratch KV
    cache, alive throughout the peak, and returns its bytes (as nano-vllm does)."""
    memory.reset_peak()
    scratch = warm_up()
    free, total = memory.mem_get_info()
    reserve = max(memory.peak_allocated() - memory.allocated() - scratch, 0)
    logger.info("warm-up: %.1f MiB of activations held in reserve", reserve / 2**20)
    return max(int(total * utilization) - (total - free) - reserve, 0)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        make_current(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.activation_quantization = activation_quantization(config, self.device, self.dtype)
        started = time.monotonic()
        loaded = load_model(config.model, self.dtype, weight_quantization(config, self.device))
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        spec = config.speculative_config
        draft = self._load_draft(spec.model) if spec is not None and spec.model else None
        self.runner = ModelRunner(
            loaded,
            self.device,
            self.dtype,
            config.block_size,
            config.attention_backend,
            config.kv_cache_dtype,
            draft,
            config.enforce_eager,
            self.activation_quantization,
        )
        del loaded
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
        num_blocks = self._kv_budget() // self.runner.bytes_per_block
        pool_tokens = num_blocks * config.block_size
        if self.max_model_len > pool_tokens:
            raise ValueError(
                f"max_model_len ({self.max_model_len} tokens) does not fit in the KV cache pool "
                f"({pool_tokens} tokens = {num_blocks} blocks of {config.block_size}); raise "
                f"kv_cache_memory_bytes or lower max_model_len"
            )
        self.runner.allocate_kv_cache(num_blocks)
        logger.info(
            "KV cache pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%s), %s",
            num_blocks,
            config.block_size,
            pool_tokens,
            num_blocks * self.runner.bytes_per_block / 2**20,
            "target and draft model" if draft else "model",
            str(self.runner.kv_cache_dtype).removeprefix("torch."),
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.speculator = None
        if spec is not None:
            proposer = DraftModelProposer(draft, self.block_manager) if draft else None
            self.speculator = Speculator(spec, proposer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._pending: list[RequestOutput] = []  # aborts, handed out by the next step
        self.grammar_compiler = None
        if self.tokenizer is not None:
            self.grammar_compiler = GrammarCompiler(
                self.tokenizer,
                self.model_config.vocab_size,
                self.grammar_stop_token_ids,
                config.structured_outputs_compile_timeout,
            )
        # Sequences whose grammar is still compiling: they join the scheduler when it is.
        self._awaiting_grammar: dict[Sequence, Future] = {}

    def _load_draft(self, uri: str) -> ModelRunner:
        """The draft model's runner (speculative decoding), in the target's dtype,
        quantization, attention backend and KV cache dtype."""
        config = self.config
        loaded = load_model(uri, self.dtype, weight_quantization(config, self.device))
        check_vocabulary(loaded, self.model_config, self.tokenizer)
        logger.info("draft model %s: %d layers", loaded.name, loaded.config.num_layers)
        return ModelRunner(
            loaded,
            self.device,
            self.dtype,
            config.block_size,
            config.attention_backend,
            config.kv_cache_dtype,
            enforce_eager=config.enforce_eager,
            activation_quantization=self.activation_quantization,
        )

    def _kv_budget(self) -> int:
        """On CUDA the warm-up runs first (its kernels compile before the engine is ready),
        and its activation peak is kept out of the budget. The CPU budget is a fixed size,
        not a share of measured free memory, so there is no peak to subtract, and the
        CPU kernels need no compiling: it skips the warm-up, which would only cost
        start-up time."""
        config = self.config
        budget = _CPU_DEFAULT_KV_BYTES
        if self.device.type == "cuda":
            memory = CudaMemory(self.device)
            budget = kv_cache_budget(memory, config.gpu_memory_utilization, self._warm_up)
        return budget if config.kv_cache_memory_bytes is None else config.kv_cache_memory_bytes

    def _warm_up(self) -> int:
        config = self.config
        return self.runner.warm_up(
            config.max_num_batched_tokens, self.max_model_len, config.max_num_seqs
        )

    # -- requests ----------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and tokenize; safe to call from any thread. Raises ValueError."""
        prompt = prompt_token_ids(prompt, self.tokenizer, self.model_name)
        return validate_request(
            request_id, prompt, params, self.limits, self.grammar_compiler, arrival_time
        )

    @property
    def limits(self) -> "RequestLimits":
        return RequestLimits(
            self.max_model_len, self.model_config.vocab_size, self.config.max_num_seqs
        )

    @property
    def grammar_stop_token_ids(self) -> list[int]:
        """The tokens that end a structured output (the model's EOS ids)."""
        config = self.model_config
        return sorted({*config.eos_token_ids, config.eos_token_id} - {None})

    def detach_tokenizer(self):
        """Stop making text and hand the tokenizer over: from here on this engine is a core
        that sees token ids only, and the caller (a frontend) detokenizes and matches stop
        strings. Call before adding requests. The grammar compiler, built with the engine,
        keeps its reference to the tokenizer: xgrammar reads the vocabulary from it to make
        the token masks, which the core applies in its steps."""
        tokenizer, self.tokenizer = self.tokenizer, None
        self.output_processor = OutputProcessor(None)
        return tokenizer

    def add(self, request: Request) -> None:
        """Queue a validated request (engine thread only)."""
        if request.request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        params = request.params

        def generator(index: int) -> torch.Generator | None:
            if params.seed is None:
                return None
            # On the device the sampler draws on (see engine/sampler.py).
            generator = torch.Generator(device=self.device)
            return generator.manual_seed((params.seed + index) % 2**63)

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
        )
        self.output_processor.add_request(
            request.request_id, request.prompt_token_ids, params, request.arrival_time
        )
        if params.structured_outputs is None:
            self.scheduler.add(seq)
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
                seq.grammar = GrammarMatcher(future.result())
            except ValueError as exc:
                self.abort_request(seq.request_id, reason="error", error=str(exc))
                continue
            self.scheduler.add(seq)

    def _wait_for_a_grammar(self) -> None:
        """With nothing to run but sequences whose grammar is compiling, wait a moment for
        one compile rather than spin through empty steps (short, so that new requests and
        aborts are still taken between steps)."""
        if self._awaiting_grammar:
            wait(self._awaiting_grammar.values(), timeout=0.05, return_when=FIRST_COMPLETED)

    def _with_model_eos(self, params: SamplingParams) -> SamplingParams:
        """The model's EOS ids beyond its main one (generation_config's list) end a
        sequence as its EOS does; they ride along as stop token ids."""
        config = self.model_config
        extra = tuple(t for t in config.eos_token_ids if t != config.eos_token_id)
        if params.ignore_eos or not extra:
            return params
        return replace(params, stop_token_ids=(*params.stop_token_ids, *extra))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self.add(self.make_request(request_id, prompt, params))

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
        output = self.output_processor.finish(request_id, reason, time.time(), error, sample_index)
        if output is not None:
            self._pending.append(output)

    def running_request_ids(self) -> set[str]:
        return {seq.request_id for seq in self.scheduler.running}

    def unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.requests)

    def step_pending(self) -> list[RequestOutput]:
        """Hand out the outputs of aborted requests without running a step."""
        outputs, self._pending = self._pending, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished() or bool(self._pending) or bool(self._awaiting_grammar)
        )

    # -- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Raises EngineFault when the step failed for all of its sequences (their
        requests' error outputs are then handed out by `step_pending`)."""
        self._admit_compiled()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        step = self.scheduler.schedule()
        if step.is_empty:
            self._wait_for_a_grammar()
            return self.step_pending()
        now = time.time()
        for item in step.scheduled:
            self.output_processor.mark_scheduled(item.seq, now)
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
        step_outputs, stopped = self.output_processor.process(new_tokens, time.time())
        for seq in stopped:
            self.scheduler.finish(seq, "stop")
        return self.step_pending() + step_outputs

    def _execute_isolating(
        self, items: list[ScheduledSeq]
    ) -> tuple[dict[Sequence, list[SampledToken]], dict[str, Exception]]:
        """Run `items`; if that fails, run each half on its own, down to single sequences.
        Returns the sampled tokens of what ran and the error of each request that failed.
        A retry recomputes the same tokens into the same KV slots, so it is safe."""
        try:
            return self.runner.execute(SchedulerOutput(items, [])), {}
        except Exception as exc:  # noqa: BLE001 - isolated below, raised by step() if total
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
        )
