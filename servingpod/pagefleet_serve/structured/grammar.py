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
"""

import collections
import json
import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from pagefleet_serve.structured.constraint import StructuredOutputs

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse; a schema sent again (the usual case: one schema per
# application) then costs a dictionary lookup.
CACHE_SIZE = 256
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
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, matcher in matchers.items():
        matcher.fill_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(matchers))


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe. The vocabulary is read on the
    first constraint (a quarter of a second), so servers that never see one pay nothing."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[StructuredOutputs, Future] = collections.OrderedDict()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def compile_async(self, constraint: StructuredOutputs) -> Future:
        """A future of the compiled grammar (ValueError naming the problem if it cannot
        be compiled); the same future for the same constraint while it is cached."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                return future
            future = self._worker.submit(self._compile, constraint)
            self._cache[constraint] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        """Compile (or find in the cache) and wait; raises ValueError."""
        return self.compile_async(constraint).result()

    def matcher(self, constraint: StructuredOutputs) -> GrammarMatcher:
        return GrammarMatcher(self.compile(constraint))

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
            return compiler.compile_grammar(constraint.grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar's errors for bad input vary by kind
            message = (_NOISE.sub("", str(exc)).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(
                f"{constraint.field}: the {constraint.kind} constraint cannot be compiled: "
                f"{message}"
            ) from None

    def _xgrammar_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:  # only the worker thread gets here
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer,
                vocab_size=self._vocab_size,
                stop_token_ids=self._stop_token_ids or None,  # None: the tokenizer's EOS
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler
