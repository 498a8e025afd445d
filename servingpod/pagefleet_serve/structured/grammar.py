"""Constraints -> token masks, with xgrammar (chosen over llguidance by measurement: see
`benchmarks/bench_grammar_engines.py` and the README; its per-token mask, which runs in
every step, is several times cheaper, and it is vLLM's default engine).

`GrammarCompiler` compiles a `StructuredOutputs` once per distinct constraint, in its own
worker thread, and keeps the result in an LRU cache: the frontend compiles while it
validates a request (so a bad schema is a 400 before anything starts) and the engine then
finds the grammar compiled; a request whose grammar is still compiling waits outside the
scheduler, never inside a step. Each sequence then holds its own `GrammarMatcher`, which
advances with the sequence's output tokens only, so it stays right when the sequence is
recomputed after preemption, hits the prefix cache or is prefilled in chunks.

A compile is bounded in time (`compile_timeout`, the engine's
`structured_outputs_compile_timeout`): past it, the constraint's future fails with a
ValueError naming the constraint, so the request waiting for it is refused (a 400) and a
request of the same constraint sent meanwhile fails at once. xgrammar cannot stop a compile,
so it runs on in its worker; when it ends, its grammar replaces the failure in the cache.
Compiles run in a few workers, so one slow schema does not hold up the others.
"""

import collections
import json
import logging
import re
import threading
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

import torch
import xgrammar as xgr

from pagefleet_serve.structured.constraint import StructuredOutputs

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse; a schema sent again (the usual case: one schema per
# application) then costs a dictionary lookup.
CACHE_SIZE = 256
# A compile that outlives its timeout keeps its worker; the others serve other constraints.
COMPILE_WORKERS = 4
DEFAULT_COMPILE_TIMEOUT_S = 30.0
# How much of a constraint an error message quotes to name it.
_EXCERPT_CHARS = 80
# xgrammar prefixes its messages with a time and a C++ source location; users need neither.
_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled)

    def fork(self, output_token_ids: list[int]) -> "GrammarMatcher":
        """A matcher of the same grammar at the point these output tokens lead to (a
        sibling sample of n > 1)."""
        sibling = GrammarMatcher(self._compiled)
        for token_id in output_token_ids:
            sibling.accept(token_id)
        return sibling

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


def mask_logits(logits: torch.Tensor, matchers: dict[int, GrammarMatcher]) -> None:
    """Set to -inf, in place, the logits of tokens each row's grammar forbids next;
    `matchers` maps row -> matcher and only those rows are touched."""
    # Uninitialized: each masked row is written whole by its matcher, and the other rows
    # are not read. xgrammar's allocator fills the whole tensor, a parallel op that costs
    # milliseconds a step when the CPU's cores are contended.
    shape = xgr.get_bitmask_shape(logits.shape[0], logits.shape[1])
    bitmask = torch.empty(shape, dtype=xgr.bitmask_dtype)
    for row, matcher in matchers.items():
        matcher.fill_bitmask(bitmask, row)
    # xgrammar fills the mask on the host; it is applied where the logits are.
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(matchers))


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe. The vocabulary is read on the
    first constraint (a quarter of a second), so servers that never see one pay nothing.
    `_compile` is where a constraint becomes a grammar, and nothing else does."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self.compile_timeout = compile_timeout
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()  # the cache
        self._setup_lock = threading.Lock()  # the xgrammar compiler, made on first use
        self._cache: collections.OrderedDict[StructuredOutputs, Future] = collections.OrderedDict()
        self._worker = ThreadPoolExecutor(max_workers=COMPILE_WORKERS, thread_name_prefix="grammar")

    def compile_async(self, constraint: StructuredOutputs) -> Future:
        """A future of the compiled grammar (ValueError naming the problem if it cannot
        be compiled, or not within the timeout); the same future for the same constraint
        while it is cached."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                return future
            future = Future()
            # Shared by every request of this constraint: running, so none of them can
            # cancel it (an awaiting task that is cancelled cancels what it awaits).
            future.set_running_or_notify_cancel()
            self._cache[constraint] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        timer = threading.Timer(self.compile_timeout, self._time_out, (constraint, future))
        timer.daemon = True
        timer.start()
        work = self._worker.submit(self._compile, constraint)
        work.add_done_callback(lambda done: self._compiled(constraint, future, done, timer))
        return future

    def compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        """Compile (or find in the cache) and wait; raises ValueError."""
        return self.compile_async(constraint).result()

    def matcher(self, constraint: StructuredOutputs) -> GrammarMatcher:
        return GrammarMatcher(self.compile(constraint))

    def _time_out(self, constraint: StructuredOutputs, future: Future) -> None:
        excerpt = str(getattr(constraint, constraint.kind))
        if len(excerpt) > _EXCERPT_CHARS:
            excerpt = excerpt[:_EXCERPT_CHARS] + "..."
        _settle(
            future,
            exception=ValueError(
                f"{constraint.field}: the {constraint.kind} constraint {excerpt!r} did not "
                f"compile within {self.compile_timeout:g} s (the server's "
                f"--structured-outputs-compile-timeout); a smaller or simpler one compiles faster"
            ),
        )

    def _compiled(
        self, constraint: StructuredOutputs, future: Future, work: Future, timer: threading.Timer
    ) -> None:
        timer.cancel()
        result, error = None, work.exception()
        if error is None:
            result = work.result()
        if _settle(future, result, error):
            return
        # Too late for the requests that waited; kept for those to come.
        late = Future()
        _settle(late, result, error)
        with self._lock:
            if self._cache.get(constraint) is future:
                self._cache[constraint] = late

    def _compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        compiler = self._xgrammar_compiler()
        try:
            if constraint.json is not None:
                return compiler.compile_json_schema(
                    constraint.json, any_whitespace=False, strict_mode=True
                )
            if constraint.json_object:
                return compiler.compile_builtin_json_grammar()
            if constraint.regex is not None:
                return compiler.compile_regex(constraint.regex)
            if constraint.choice is not None:
                alternatives = " | ".join(json.dumps(c) for c in constraint.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            if constraint.structural_tag is not None:
                return compiler.compile_structural_tag(constraint.structural_tag)
            return compiler.compile_grammar(constraint.grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar's errors for bad input vary by kind
            message = (_NOISE.sub("", str(exc)).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(
                f"{constraint.field}: the {constraint.kind} constraint cannot be compiled: "
                f"{message}"
            ) from None

    def _xgrammar_compiler(self) -> xgr.GrammarCompiler:
        with self._setup_lock:
            if self._compiler is None:
                self._compiler = self._new_xgrammar_compiler()
            return self._compiler

    def _new_xgrammar_compiler(self) -> xgr.GrammarCompiler:
        info = xgr.TokenizerInfo.from_huggingface(
            self._tokenizer,
            vocab_size=self._vocab_size,
            stop_token_ids=self._stop_token_ids or None,  # None: the tokenizer's EOS
        )
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _settle(future: Future, result=None, exception: BaseException | None = None) -> bool:
    """Set a future's outcome unless it has one (the compile and its timeout race)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True
