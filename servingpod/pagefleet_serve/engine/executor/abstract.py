"""What the engine core asks of the model, whatever the number of ranks: each call that
runs the model or sizes its KV cache is made on every rank with the same inputs
(`on_every_rank`); what only the core holds, the sequences' sampling state, the pooler and
a draft model, stays with rank 0's `runner`, which plans each step and samples it."""

from abc import ABC, abstractmethod
from collections.abc import Callable

from pagefleet_serve.engine.model_runner import ModelRunner
from pagefleet_serve.engine.sampler import SampledToken
from pagefleet_serve.engine.scheduler import SchedulerOutput
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.model.lora import LoRAAdapter
from pagefleet_serve.model.tensor_parallel import TensorParallel


class Executor(ABC):
    def __init__(self, tp: TensorParallel) -> None:
        """`tp`: rank 0's place, which its shard is loaded for."""
        self.tp = tp
        # Rank 0's runner (this process's shard), given by start-up once it is loaded: the
        # other ranks load theirs meanwhile.
        self.runner: ModelRunner

    @abstractmethod
    def on_every_rank(self, method: str, *args: object):
        """Have every rank's runner call `method(*args)`; rank 0's result."""

    def execute(self, step: SchedulerOutput) -> dict[Sequence, list[SampledToken]]:
        """Run a scheduled step: every rank runs its batch, rank 0 samples."""
        plan = self.runner.plan(step)
        return self.runner.sample(plan, *self.on_every_rank("forward_batch", plan.batch))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.on_every_rank("allocate_kv_cache", num_blocks)

    def warm_up(self, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> int:
        """See `ModelRunner.warm_up`: rank 0's scratch bytes."""
        return self.on_every_rank("warm_up", max_num_batched_tokens, max_model_len, max_num_seqs)

    def warm_up_kernels(self, max_num_seqs: int) -> None:
        self.on_every_rank("warm_up_kernels", max_num_seqs)

    def load_lora(self, slot: int, adapter: LoRAAdapter) -> None:
        self.on_every_rank("load_lora", slot, adapter)

    @abstractmethod
    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call `on_lost(reason)`, from a thread of its own, if a rank exits unasked."""

    @abstractmethod
    def close(self) -> None:
        """End the other ranks, if any (no step runs after this)."""
