"""A request's way from the frontend to the scheduler: checked against this engine (its id
not running already, embeddings only on an embed engine, its adapter served), made a
`Sequence` (its seeded generators on the sampler's device, the model's extra EOS ids as
stop tokens), then held, without holding up a step, while its grammar compiles and while
its adapter is read back into host memory (`LoRAManager`); then it joins the scheduler. A
reasoning model's sequence gets its constraint behind the thinking (`output_constraint`:
the grammar starts where the thinking ends, a thinking budget forces that end)."""

from collections.abc import Container
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace

import torch

from pagefleet_serve.config import EngineConfig, PoolingConfig
from pagefleet_serve.engine.lora_manager import LoRAManager
from pagefleet_serve.engine.scheduler import Scheduler
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.messages import Request
from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.sampling_params import SamplingParams, generator_seed, sample_seed
from pagefleet_serve.structured.grammar import GrammarCompiler, GrammarMatcher
from pagefleet_serve.structured.thinking_gate import output_constraint

# A sequence that cannot run, and why (its request fails with that error).
Failure = tuple[Sequence, str]


def grammar_stop_token_ids(config: ModelConfig) -> list[int]:
    """The tokens that end a structured output (the model's EOS ids)."""
    return sorted({*config.eos_token_ids, config.eos_token_id} - {None})


def make_grammar_compiler(
    tokenizer, model_config: ModelConfig, config: EngineConfig
) -> GrammarCompiler | None:
    """The engine's grammar compiler, the one place constraints are compiled; None for a
    model served on token ids (no tokenizer to make token masks from)."""
    if tokenizer is None:
        return None
    return GrammarCompiler(
        tokenizer,
        model_config.vocab_size,
        grammar_stop_token_ids(model_config),
        config.structured_outputs_compile_timeout,
    )


class Admission:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        scheduler: Scheduler,
        loras: LoRAManager,
        *,
        device: torch.device,
        pooling: PoolingConfig | None,
        grammar_compiler: GrammarCompiler | None,
    ) -> None:
        """`device`: the sampler's, where a request's seeded generators draw."""
        self.config = config
        self.model_config = model_config
        self.device = device
        self.pooling = pooling
        self.scheduler = scheduler
        self.loras = loras
        self.grammar_compiler = grammar_compiler
        # Sequences whose grammar is still compiling, and those whose adapter is being read
        # back into host memory.
        self._awaiting_grammar: dict[Sequence, Future] = {}
        self._awaiting_lora: list[Sequence] = []

    def sequence(self, request: Request, running: Container[str]) -> Sequence:
        """The sequence of a request the frontend validated; ValueError (LoRANotFound for
        an adapter not served) when this engine cannot take it. `running`: the request ids
        this engine has not finished."""
        if request.request_id in running:
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

        return Sequence(
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
            lora_id=self.loras.lora_id(request.lora_name),
            pooling=request.pooling,
            client=request.client,
            images=request.images,
        )

    def _with_model_eos(self, params: SamplingParams) -> SamplingParams:
        """The model's EOS ids beyond its main one (generation_config's list) end a
        sequence as its EOS does; they ride along as stop token ids."""
        config = self.model_config
        extra = tuple(t for t in config.eos_token_ids if t != config.eos_token_id)
        if params.ignore_eos or not extra:
            return params
        return replace(params, stop_token_ids=(*params.stop_token_ids, *extra))

    def add(self, seq: Sequence) -> list[Failure]:
        """Admit a new sequence: to the scheduler, or held until its grammar has compiled
        (failed at once if it is known not to)."""
        constraint = seq.params.structured_outputs
        if constraint is None:
            seq.grammar = output_constraint(seq.params.thinking, None)  # a thinking budget
            self._to_scheduler(seq)
            return []
        self._awaiting_grammar[seq] = self.grammar_compiler.compile_async(constraint)
        return self._admit_compiled()

    def admit(self) -> list[Failure]:
        """Hand the scheduler the held sequences that can run now; those that never can
        (their grammar cannot compile, their adapter cannot be read) are dropped and
        returned."""
        return self._admit_compiled() + self._admit_read_back()

    def _admit_compiled(self) -> list[Failure]:
        failed = []
        for seq, future in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[seq]
            try:
                grammar = GrammarMatcher(future.result())
            except ValueError as exc:
                failed.append((seq, str(exc)))
                continue
            # A thinking model's grammar starts where its thinking ends.
            seq.grammar = output_constraint(seq.params.thinking, grammar)
            self._to_scheduler(seq)
        return failed

    def _admit_read_back(self) -> list[Failure]:
        """Sequences whose adapter is not in host memory wait while it is read again from
        its path, once the cache has a place for it (one no request uses); they join the
        scheduler when it is in."""
        if not self._awaiting_lora and not self.loras.reading:
            return []
        failed = []
        for lora_id, exc in self.loras.finish_reads().items():
            for seq in [s for s in self._awaiting_lora if s.lora_id == lora_id]:
                self._awaiting_lora.remove(seq)
                name = self.loras.served(lora_id).name  # served: unload waits for its requests
                failed.append((seq, f"the LoRA adapter {name!r} could not be read again: {exc}"))
        in_use = self.lora_ids_in_use()
        waiting, self._awaiting_lora = self._awaiting_lora, []
        for seq in waiting:
            if self.loras.use(seq.lora_id):
                self.scheduler.add(seq)
                continue
            self._awaiting_lora.append(seq)
            self.loras.read_back(seq.lora_id, in_use)
        return failed

    def _to_scheduler(self, seq: Sequence) -> None:
        """A sequence ready to run joins the scheduler, once its adapter is in host memory."""
        if self.loras.use(seq.lora_id):
            self.scheduler.add(seq)
        else:
            self._awaiting_lora.append(seq)

    def drop(self, request_id: str, sample_index: int | None = None) -> None:
        """Stop holding a request's sequences (or one sample's)."""
        for seq in [s for s in self._awaiting_grammar if s.request_id == request_id]:
            if sample_index is None or seq.sample_index == sample_index:
                del self._awaiting_grammar[seq]
        self._awaiting_lora = [
            s
            for s in self._awaiting_lora
            if s.request_id != request_id or sample_index not in (None, s.sample_index)
        ]

    @property
    def num_awaiting_lora(self) -> int:
        return len(self._awaiting_lora)

    @property
    def holds_any(self) -> bool:
        return bool(self._awaiting_grammar) or bool(self._awaiting_lora)

    def waiting(self) -> list[Sequence]:
        """The sequences not running: the scheduler's waiting ones and those held here."""
        return [*self.scheduler.waiting, *self._awaiting_grammar, *self._awaiting_lora]

    def users(self) -> list[Sequence]:
        """The sequences that read, or will read, their adapter (or the base model)."""
        return [*self.scheduler.running, *self.waiting()]

    def lora_ids_in_use(self) -> set[int | None]:
        return {seq.lora_id for seq in self.users()}

    def wait_for_pending(self) -> None:
        """With nothing to run but sequences whose grammar is compiling or whose adapter is
        being read, wait a moment for one rather than spin through empty steps (short, so
        that new requests and aborts are still taken between steps)."""
        pending = [*self._awaiting_grammar.values(), *self.loras.reading]
        if pending:
            wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
