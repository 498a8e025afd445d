"""Constraints -> token masks, with xgrammar (chosen over llguidance by measurement: see
`benchmarks/bench_grammar_engines.py` and the README; its per-token mask, which runs in
every step, is several times cheaper, and it is vLLM's default engine).

`GrammarCompiler` compiles a `StructuredOutputs` once per distinct constraint and keeps
the result in an LRU cache. It lives in the engine core, the one place a constraint is
compiled: the frontend asks the core to compile a request's constraint before it sends
the request (`compile_requests`: a bad schema is then a 400 before anything starts) and
the engine finds the grammar compiled when the request comes; a request whose grammar is
still compiling waits outside the scheduler, never inside a step.
Each sequence then holds its own `GrammarMatcher`, which advances with the sequence's
output tokens only, so it stays right when the sequence is recomputed after preemption,
hits the prefix cache or is prefilled in chunks.

A compile runs in a worker process (`compile_worker`), a few at a time, so that one slow
schema does not hold up the others and none can grow this process: each worker's memory
is capped (`memory_limit_bytes`), and it is killed at the compile timeout (counted from
the start of the compile, not from when it was queued) or as soon as nobody waits for
its compile any more. Past the timeout the constraint's future fails with a ValueError
naming it, so the request waiting for it is refused (a 400), and the failure stays cached:
the same constraint sent again fails at once instead of costing another timeout.

Callers that admit untrusted requests name a `client`: their compiles wait in a bounded
queue (`max_queued`), each client may have at most `max_per_client` compiles queued or
running (`CompileQueueFull` beyond either: a 429) and hold at most
`max_running_per_client` workers (all but one, at most half the CPUs the process may use
and two at least: a free worker takes the job of the client compiling least, so one
client's slow compiles never hold every worker), and
each such call is a waiter to `stop_waiting` when it stops waiting; a queued or running
compile with no waiter left is dropped. Callers without a client (the engine, offline
use) are always served.
"""

import collections
import json
import logging
import re
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Protocol

import torch
import xgrammar as xgr

from pagefleet_serve.cpu_placement import available_cpus, cpu_quota, usable_cpus
from pagefleet_serve.structured.compile_worker import CompileFailed, CompileWorker
from pagefleet_serve.structured.constraint import CompileQueueFull, StructuredOutputs

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse; a schema sent again (the usual case: one schema per
# application) then costs a dictionary lookup.
CACHE_SIZE = 256
# Worker processes, started as compiles need them (one spare kept warm) and kept.
COMPILE_WORKERS = 4
DEFAULT_COMPILE_TIMEOUT_S = 30.0
# What a compile may add to its worker's address space before it fails.
DEFAULT_COMPILE_MEMORY_BYTES = 2 * 2**30
DEFAULT_MAX_QUEUED_COMPILES = 64
DEFAULT_MAX_COMPILES_PER_CLIENT = 4
# How much of a constraint an error message quotes to name it.
_EXCERPT_CHARS = 80
# xgrammar prefixes its messages with a time and a C++ source location; users need neither.
_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


@dataclass(eq=False)
class _Job:
    constraint: StructuredOutputs
    future: Future
    client: str | None
    waiters: int = 0  # callers with a client that still wait
    pinned: bool = False  # a caller without a client waits: never dropped
    started: bool = False
    deadline: float = 0.0  # time.monotonic(), once started

    @property
    def wanted(self) -> bool:
        return self.pinned or self.waiters > 0

    def join(self, client: str | None) -> None:
        if client is None:
            self.pinned = True
        else:
            self.waiters += 1


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

    @property
    def masks_next(self) -> bool:
        """Whether the next token is constrained (a thinking model's gate may say no)."""
        return not self.is_terminated


class RowMask(Protocol):
    """What masks a row: a grammar's matcher, or a thinking model's gate."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...


def mask_logits(logits: torch.Tensor, matchers: Mapping[int, RowMask]) -> None:
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


def default_running_per_client(workers: int) -> int:
    """Workers one client's compiles may hold by default: all but one (kept for the other
    clients), no more than half the CPUs this process may use (its affinity, its cgroup's
    quota), so that one client's slow schemas leave cores to the engine; and two at least
    (while there are three workers): a client is an address, and behind a proxy every
    request has the proxy's, so with one worker its one slow schema would hold up every
    other constraint it sends. On a 2-core pod that is both cores; the compile timeout
    bounds for how long."""
    half = usable_cpus(available_cpus(), cpu_quota()) // 2
    return max(1, min(workers - 1, max(2, half)))


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe. The vocabulary is read on the
    first constraint (a quarter of a second), so servers that never see one pay nothing.
    `_compile` is where a constraint becomes a grammar, and nothing else does; it runs in
    one of the compile threads, each of which drives one worker process."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S,
        *,
        memory_limit_bytes: int = DEFAULT_COMPILE_MEMORY_BYTES,
        max_queued: int = DEFAULT_MAX_QUEUED_COMPILES,
        max_per_client: int = DEFAULT_MAX_COMPILES_PER_CLIENT,
        workers: int = COMPILE_WORKERS,
        max_running_per_client: int | None = None,
    ) -> None:
        """`max_running_per_client`: workers one client's compiles may hold at once
        (default: `default_running_per_client`)."""
        if max_running_per_client is None:
            max_running_per_client = default_running_per_client(workers)
        for name, value in (
            ("memory_limit_bytes", memory_limit_bytes),
            ("max_queued", max_queued),
            ("max_per_client", max_per_client),
            ("workers", workers),
            ("max_running_per_client", max_running_per_client),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self.compile_timeout = compile_timeout
        self.memory_limit_bytes = memory_limit_bytes
        self.max_queued = max_queued
        self.max_per_client = max_per_client
        self._max_workers = workers
        self.max_running_per_client = max_running_per_client
        self._tokenizer_info: tuple[xgr.TokenizerInfo, str] | None = None
        self._setup_lock = threading.Lock()  # the tokenizer info, made on first use
        # The cache, the queue and the jobs in flight; compile threads wait on it for work.
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._cache: collections.OrderedDict[StructuredOutputs, Future] = collections.OrderedDict()
        self._jobs: dict[Future, _Job] = {}  # not settled yet
        self._queue: collections.deque[_Job] = collections.deque()
        self._per_client: collections.Counter[str] = collections.Counter()
        self._running: collections.Counter[str] = collections.Counter()  # compiling, per client
        self._threads = 0
        self._idle = 0
        self._closed = False
        self._local = threading.local()  # a compile thread's worker and job

    def compile_async(self, constraint: StructuredOutputs, client: str | None = None) -> Future:
        """A future of the compiled grammar (ValueError naming the problem if it cannot
        be compiled, or not within the timeout); the same future for the same constraint
        while it is cached. With a `client`: CompileQueueFull when the queue or the
        client's budget is full, and the caller must `stop_waiting` on the future when it stops
        waiting for it (done or not)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                if (job := self._jobs.get(future)) is not None:
                    job.join(client)
                return future
            if client is not None:
                self._check_budget(client)
            future = Future()
            # Shared by every request of this constraint: running, so none of them can
            # cancel it (an awaiting task that is cancelled cancels what it awaits).
            future.set_running_or_notify_cancel()
            job = _Job(constraint, future, client)
            job.join(client)
            self._cache[constraint] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            self._jobs[future] = job
            if client is not None:
                self._per_client[client] += 1
            self._queue.append(job)
            if len(self._queue) > self._idle:
                self._add_thread()
            self._work.notify()
        return future

    def stop_waiting(self, future: Future) -> None:
        """One waiter with a client stops waiting; a compile nobody waits for is dropped
        (taken off the queue, or its worker killed)."""
        with self._lock:
            job = self._jobs.get(future)
            if job is None:
                return
            job.waiters -= 1
            if job.wanted or job.started:  # a running one: its thread sees it and kills
                return
            self._queue.remove(job)
        self._finish(job, None, self._abandoned(job.constraint))

    def close(self) -> None:
        """End the compile threads and their worker processes (a compile in flight first
        finishes or times out); queued compiles fail. Idempotent."""
        with self._lock:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._work.notify_all()
        for job in queued:
            self._finish(job, None, RuntimeError("the grammar compiler is closed"))

    def compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        """Compile (or find in the cache) and wait; raises ValueError."""
        return self.compile_async(constraint).result()

    def matcher(self, constraint: StructuredOutputs) -> GrammarMatcher:
        return GrammarMatcher(self.compile(constraint))

    def _check_budget(self, client: str) -> None:
        if len(self._queue) >= self.max_queued:
            raise CompileQueueFull(
                f"{len(self._queue)} grammar compiles are waiting for a worker (the limit); "
                "retry later"
            )
        if self._per_client[client] >= self.max_per_client:
            raise CompileQueueFull(
                f"this client already has {self._per_client[client]} grammar compiles queued "
                f"or running (at most {self.max_per_client}); retry when they have finished"
            )

    # -- the compile threads -------------------------------------------------------------
    def _add_thread(self) -> None:
        """One more compile thread, up to `workers` (call holding the lock)."""
        if self._threads < self._max_workers and not self._closed:
            self._threads += 1
            threading.Thread(target=self._serve, name="grammar", daemon=True).start()

    def _serve(self) -> None:
        """A compile thread: its worker is started first, so that a spare is warm when a
        compile arrives while the others are busy (a worker takes a second or more to
        start); each compile that leaves no thread idle starts the next spare. Ends, with
        its worker, when the compiler is closed."""
        self._local.worker = None
        try:
            self._start_worker()
        except (OSError, RuntimeError):
            logger.exception("cannot start a grammar compile worker")
        try:
            self._take_jobs()
        finally:
            if self._local.worker is not None:
                self._local.worker.kill()

    def _take_jobs(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
                job = None
                while not self._closed and (job := self._next_job()) is None:
                    self._work.wait()
                self._idle -= 1
                if job is None:  # closed
                    return
                self._queue.remove(job)
                job.started = True
                if job.client is not None:
                    self._running[job.client] += 1
                if not self._idle:
                    self._add_thread()
            self._run(job)

    def _next_job(self) -> _Job | None:
        """The queued job a free worker takes (call holding the lock): the first of the
        client compiling least, skipping clients at `max_running_per_client`; callers
        without a client come first. None: nothing it may take."""
        best: _Job | None = None
        for job in self._queue:
            if job.client is None:
                return job
            running = self._running[job.client]
            if running >= self.max_running_per_client:
                continue
            if best is None or running < self._running[best.client or ""]:
                best = job
        return best

    def _run(self, job: _Job) -> None:
        try:
            self._start_worker()
        except (OSError, RuntimeError) as exc:
            logger.exception("cannot start a grammar compile worker")
            self._finish(job, None, RuntimeError(f"cannot start a grammar compile worker: {exc}"))
            return
        job.deadline = time.monotonic() + self.compile_timeout
        timer = threading.Timer(self.compile_timeout, self._time_out, (job.constraint, job.future))
        timer.daemon = True
        timer.start()
        self._local.job = job
        result, error = None, None
        try:
            result = self._compile(job.constraint)
        except Exception as exc:  # noqa: BLE001 - handed to the waiters
            error = exc
        finally:
            timer.cancel()
        self._finish(job, result, error)

    def _start_worker(self) -> None:
        worker: CompileWorker | None = self._local.worker
        if worker is None or not worker.alive:
            _, info_json = self._tokenizer_info_pair()
            self._local.worker = CompileWorker(info_json, self.memory_limit_bytes)

    def _finish(self, job: _Job, result, error: BaseException | None) -> None:
        """Hand the outcome to the waiters; a failure that says nothing about the
        constraint (dropped, no worker) leaves the cache, a late success replaces the
        timeout's failure there."""
        settled = _settle(job.future, result, error)
        with self._lock:
            self._jobs.pop(job.future, None)
            if job.client is not None:
                self._per_client[job.client] -= 1
                if not self._per_client[job.client]:
                    del self._per_client[job.client]
                if job.started:
                    self._running[job.client] -= 1
                    if not self._running[job.client]:
                        del self._running[job.client]
                    self._work.notify_all()  # a job of its client may now be taken
            cached = self._cache.get(job.constraint) is job.future
            if cached and isinstance(error, (_Abandoned, RuntimeError)):
                del self._cache[job.constraint]
            elif cached and not settled and error is None:
                late = Future()  # too late for the requests that waited; kept for the next
                _settle(late, result)
                self._cache[job.constraint] = late

    def _compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        job: _Job = self._local.job
        self._start_worker()  # again: one killed meanwhile is replaced
        method, args, kwargs = _xgrammar_call(constraint)
        try:
            serialized = self._local.worker.compile(
                method, args, kwargs, job.deadline, lambda: not job.wanted
            )
        except CompileFailed as failed:
            raise self._failure(constraint, failed) from None
        info, _ = self._tokenizer_info_pair()
        return xgr.CompiledGrammar.deserialize_json(serialized, info)

    def _failure(self, constraint: StructuredOutputs, failed: CompileFailed) -> Exception:
        if failed.reason == "abandoned":
            return self._abandoned(constraint)
        if failed.reason == "deadline":
            return self._timeout_error(constraint)
        if failed.reason == "memory":
            return ValueError(
                f"{constraint.field}: the {constraint.kind} constraint {_excerpt(constraint)!r} "
                f"needs more than {self.memory_limit_bytes / 2**20:g} MiB to compile (the "
                f"server's limit for one compile); a smaller or simpler one needs less"
            )
        message = (_NOISE.sub("", failed.message).strip().splitlines() or ["refused"])[0]
        return ValueError(
            f"{constraint.field}: the {constraint.kind} constraint cannot be compiled: {message}"
        )

    def _abandoned(self, constraint: StructuredOutputs) -> "_Abandoned":
        return _Abandoned(
            f"{constraint.field}: the compile of the {constraint.kind} constraint was dropped: "
            "no request waits for it any more"
        )

    def _time_out(self, constraint: StructuredOutputs, future: Future) -> None:
        _settle(future, exception=self._timeout_error(constraint))

    def _timeout_error(self, constraint: StructuredOutputs) -> ValueError:
        return ValueError(
            f"{constraint.field}: the {constraint.kind} constraint {_excerpt(constraint)!r} did "
            f"not compile within {self.compile_timeout:g} s (the server's "
            f"--structured-outputs-compile-timeout); a smaller or simpler one compiles faster"
        )

    def _tokenizer_info_pair(self) -> tuple[xgr.TokenizerInfo, str]:
        """xgrammar's view of the vocabulary, and its JSON for the workers."""
        with self._setup_lock:
            if self._tokenizer_info is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids or None,  # None: the tokenizer's EOS
                )
                self._tokenizer_info = info, info.serialize_json()
            return self._tokenizer_info


class _Abandoned(ValueError):
    """A compile dropped because nobody waits for it (no waiter reads this)."""


def _xgrammar_call(constraint: StructuredOutputs) -> tuple[str, list, dict]:
    """The xgrammar GrammarCompiler method, and its arguments, that compiles `constraint`."""
    if constraint.json is not None:
        return (
            "compile_json_schema",
            [constraint.json],
            {"any_whitespace": False, "strict_mode": True},
        )
    if constraint.json_object:
        return "compile_builtin_json_grammar", [], {}
    if constraint.regex is not None:
        return "compile_regex", [constraint.regex], {}
    if constraint.choice is not None:
        alternatives = " | ".join(json.dumps(c) for c in constraint.choice)
        return "compile_grammar", [f"root ::= {alternatives}"], {}
    if constraint.structural_tag is not None:
        return "compile_structural_tag", [constraint.structural_tag], {}
    return "compile_grammar", [constraint.grammar], {}


def _excerpt(constraint: StructuredOutputs) -> str:
    """Enough of a constraint to name it in an error message."""
    text = str(getattr(constraint, constraint.kind))
    return text[:_EXCERPT_CHARS] + "..." if len(text) > _EXCERPT_CHARS else text


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
