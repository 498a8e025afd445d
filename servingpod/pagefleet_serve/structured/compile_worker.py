"""A grammar compile in a process of its own, where it can be bounded and stopped.

xgrammar cannot interrupt a compile, and a pathological constraint can make one allocate
without end: in the API process that is memory nobody can take back (and, in the end, the
kernel's OOM kill of the pod). Here each compile runs in a worker process whose address
space is capped (RLIMIT_AS at what it uses once ready plus `memory_limit_bytes`); the
parent kills it when its compile runs past its deadline or nobody waits for it any more,
and starts a fresh one for the next compile.

The parent sends the tokenizer's vocabulary once (xgrammar's TokenizerInfo as JSON), then
one compile at a time; the worker answers with the compiled grammar as xgrammar's JSON
serialization, which the parent loads against the same TokenizerInfo. Messages are JSON
over the worker's stdin and a duplicate of its stdout (fd 1 itself is pointed at stderr,
so that nothing a library prints can corrupt a message).

Run as `python -m pagefleet_serve.structured.compile_worker MEMORY_LIMIT_BYTES`.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection

# Methods of xgrammar's GrammarCompiler a compile may name.
METHODS = (
    "compile_json_schema",
    "compile_builtin_json_grammar",
    "compile_regex",
    "compile_grammar",
    "compile_structural_tag",
)
_PR_SET_PDEATHSIG = 1
# How often a waiting parent checks whether the compile is still wanted.
_POLL_S = 0.05


class CompileFailed(Exception):
    """The worker could not compile: `reason` is "error" (xgrammar refused the constraint:
    `message` says why), "memory" (it needed more than the limit), "deadline" or
    "abandoned" (the parent killed it)."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason
        self.message = message


class CompileWorker:
    """The parent's handle on one worker process (not thread-safe: one compile at a time)."""

    def __init__(self, tokenizer_info_json: str, memory_limit_bytes: int) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(memory_limit_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._to = Connection(os.dup(self._process.stdin.fileno()), readable=False)
        self._from = Connection(os.dup(self._process.stdout.fileno()), writable=False)
        self._process.stdin.close()
        self._process.stdout.close()
        try:
            self._to.send_bytes(tokenizer_info_json.encode())
            ready = self._answer(None, lambda: False) == {"ready": True}
        except (CompileFailed, OSError):
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError("the grammar compile worker did not start")

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def compile(self, method: str, args: list, kwargs: dict, deadline: float, abandoned) -> str:
        """`method(*args, **kwargs)` of xgrammar's GrammarCompiler, the compiled grammar as
        xgrammar's JSON; CompileFailed otherwise. Past `deadline` (time.monotonic) or once
        `abandoned()` is true, the worker is killed."""
        if time.monotonic() >= deadline:
            raise CompileFailed("deadline")
        job = {"method": method, "args": args, "kwargs": kwargs}
        self._to.send_bytes(json.dumps(job).encode())
        answer = self._answer(deadline, abandoned)
        if "grammar" in answer:
            return answer["grammar"]
        raise CompileFailed(answer["failed"], answer.get("message", ""))

    def kill(self) -> None:
        if self.alive:
            self._process.kill()
        self._process.wait()
        self._to.close()
        self._from.close()

    def _answer(self, deadline: float | None, abandoned) -> dict:
        while not self._from.poll(_POLL_S):
            if not self.alive:
                break
            if abandoned():
                self.kill()
                raise CompileFailed("abandoned")
            if deadline is not None and time.monotonic() >= deadline:
                self.kill()
                raise CompileFailed("deadline")
        try:
            return json.loads(self._from.recv_bytes())
        except (EOFError, OSError):  # it died: the memory limit is what kills a compile
            self.kill()
            raise CompileFailed("memory") from None


def _serve(memory_limit_bytes: int) -> None:
    # Gone with the parent, even in the middle of a compile.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    replies = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    jobs = Connection(0, writable=False)

    import resource

    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(jobs.recv_bytes().decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    in_use = _address_space_bytes()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = in_use + memory_limit_bytes
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    replies.send_bytes(json.dumps({"ready": True}).encode())
    while True:
        try:
            job = json.loads(jobs.recv_bytes())
        except EOFError:
            return
        try:
            method = getattr(compiler, METHODS[METHODS.index(job["method"])])
            compiled = method(*job["args"], **job["kwargs"])
            answer = {"grammar": compiled.serialize_json()}
            del compiled
        except MemoryError:
            answer = {"failed": "memory"}
        except Exception as exc:  # noqa: BLE001 - xgrammar's errors for bad input vary by kind
            message = str(exc) or type(exc).__name__
            # xgrammar passes C++'s out-of-memory on as a plain error.
            reason = "memory" if "bad_alloc" in message else "error"
            answer = {"failed": reason, "message": message}
        try:
            replies.send_bytes(json.dumps(answer).encode())
        except MemoryError:
            replies.send_bytes(json.dumps({"failed": "memory"}).encode())


def _address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
