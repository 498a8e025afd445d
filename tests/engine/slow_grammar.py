"""A grammar compiler whose one chosen constraint compiles until the test releases it (a
schema xgrammar would chew on for minutes), injected where the engine or the frontend
keeps its compiler: the compile timeout is tested without a sleep in product code."""

import threading
import time

from pagefleet_serve.structured.constraint import StructuredOutputs
from pagefleet_serve.structured.grammar import GrammarCompiler


class SlowCompiler(GrammarCompiler):
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        slow: StructuredOutputs,
        compile_timeout: float,
    ) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        self.slow = slow
        self.started = threading.Event()
        self.release = threading.Event()
        self.slow_compiles = 0  # compiles of the slow constraint begun
        self.expired = False
        # The vocabulary is read first (a loaded machine may take seconds): only the slow
        # constraint then meets the short timeout.
        self.compile(StructuredOutputs(regex="warm"))
        self.compile_timeout = compile_timeout

    @classmethod
    def of(cls, engine, slow: StructuredOutputs, compile_timeout: float) -> "SlowCompiler":
        """One for an LLMEngine's vocabulary (`engine.tokenizer`: one that has its own)."""
        config = engine.model_config
        return cls(
            engine.tokenizer,
            config.vocab_size,
            engine.grammar_stop_token_ids,
            slow,
            compile_timeout,
        )

    def _compile(self, constraint: StructuredOutputs):
        if constraint == self.slow:
            self.slow_compiles += 1
            self.started.set()
            self.release.wait(60)
            if self.expired:
                self._local.job.deadline = time.monotonic()
        return super()._compile(constraint)

    def time_out_now(self) -> None:
        """Let the slow compile go on past its deadline, as if the timeout had passed: its
        worker refuses it as it does a compile that outlives --structured-outputs-compile-
        timeout, without the test waiting that long."""
        self.expired = True
        self.release.set()
