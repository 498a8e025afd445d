"""The warm-up before the engine is ready: its activation peak is held out of the KV budget
(with a fake device memory: no GPU here), and the warm-up steps run on the real runner."""

import pytest
import torch
from pagefleet_serve.engine.device import CudaMemory, RunnerConfig, kv_cache_budget
from pagefleet_serve.engine.model_runner import ModelRunner
from pagefleet_serve.model.loader.model_loader import load_model

GiB = 1 << 30


class FakeMemory:
    """A device of `total` bytes on which torch holds `allocated` bytes and something else
    (the CUDA context) `overhead` more."""

    def __init__(self, total: int, allocated: int, overhead: int) -> None:
        self.total, self.allocated_bytes, self.overhead = total, allocated, overhead
        self.peak = allocated

    def alloc(self, size: int) -> None:
        self.allocated_bytes += size
        self.peak = max(self.peak, self.allocated_bytes)

    def free(self, size: int) -> None:
        self.allocated_bytes -= size

    def reset_peak(self) -> None:
        self.peak = self.allocated_bytes

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.allocated_bytes - self.overhead, self.total

    def allocated(self) -> int:
        return self.allocated_bytes

    def peak_allocated(self) -> int:
        return self.peak


def warm_up_on(memory: FakeMemory, scratch: int, activations: int, kept: int = 0):
    """A warm-up that allocates a scratch KV cache, then a workspace that stays (`kept`,
    as cuBLAS's on its first product), then its activations, and frees the cache and the
    activations."""

    def warm_up() -> int:
        memory.alloc(scratch)
        memory.alloc(kept)
        memory.alloc(activations)
        memory.free(activations)
        memory.free(scratch)
        return scratch

    return warm_up


@pytest.mark.parametrize("activations", [0, 3 * GiB])
def test_the_warm_up_activation_peak_is_subtracted_from_the_kv_budget(activations):
    # 80 GiB device at 0.9: 72 GiB; 16 GiB of weights and 1 GiB of context are in use.
    memory = FakeMemory(total=80 * GiB, allocated=16 * GiB, overhead=GiB)
    warm_up = warm_up_on(memory, scratch=2 * GiB, activations=activations, kept=GiB // 4)
    budget = kv_cache_budget(memory, 0.9, warm_up)
    # The scratch cache is not activations; the workspace the warm-up kept is in use.
    assert budget == int(80 * GiB * 0.9) - 17 * GiB - GiB // 4 - activations


def test_the_budget_is_never_negative():
    memory = FakeMemory(total=10 * GiB, allocated=8 * GiB, overhead=GiB)
    assert kv_cache_budget(memory, 0.9, warm_up_on(memory, GiB, 4 * GiB)) == 0


def test_the_warm_up_runs_the_largest_prefill_and_decode_and_frees_its_cache():
    loaded = load_model("builtin://tiny-random", torch.float32)
    runner = ModelRunner(
        loaded, RunnerConfig(torch.device("cpu"), torch.float32, 16, "auto", "auto")
    )
    # 100 tokens in sequences of at most 48: three of 33, 33 and 34 (3 blocks each).
    scratch = runner.warm_up(max_num_batched_tokens=100, max_model_len=48, max_num_seqs=8)
    assert scratch == 9 * runner.bytes_per_block
    assert runner.kv_cache is None and runner.kv_caches == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_warm_up_peak_is_measured_and_reserved():
    device = torch.device("cuda")
    loaded = load_model("builtin://smollm2-135m", torch.bfloat16)
    runner = ModelRunner(loaded, RunnerConfig(device, torch.bfloat16, 16, "auto", "auto"))
    memory = CudaMemory(device)
    without = kv_cache_budget(memory, 0.9, lambda: 0)
    with_warm_up = kv_cache_budget(memory, 0.9, lambda: runner.warm_up(2048, 2048, 64))
    # The prefill's gate/up output alone, 2048 x 3072 in bfloat16, is 12 MiB.
    assert without - with_warm_up >= 12 << 20
    assert runner.kv_cache is None


def _count_triton_compiles() -> list[str]:
    """Names of the Triton kernels compiled (or loaded into memory) from now on: the cache
    hook Triton calls on a kernel variant it has not got in memory (`triton.knobs` since
    Triton 3.4, `JITFunction.cache_hook` before)."""
    import triton

    compiled: list[str] = []

    def hook(*args, **kwargs) -> bool:
        compiled.append(str(kwargs.get("key", kwargs.get("fn", "kernel"))))
        return False  # go on compiling as usual

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
        knobs.runtime.jit_cache_hook = hook
    else:
        triton.runtime.jit.JITFunction.cache_hook = hook
    return compiled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_no_triton_kernel_is_compiled_after_the_engine_is_ready():
    """The warm-up runs every step shape a request can make, so that serving compiles
    nothing: prefills of several lengths, decode batches of 1 to max_num_seqs, sampling
    with and without penalties."""
    from pagefleet_serve import LLM, SamplingParams

    llm = LLM(model="builtin://smollm2-135m", device="cuda", max_num_seqs=16)
    compiled = _count_triton_compiles()
    prompts = [f"Count to {n}:" + " and" * (7 * n) for n in range(1, 13)]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, repetition_penalty=1.2),
    ]
    llm.generate(prompts, params[0])
    llm.generate(prompts[:5], params[1])
    assert compiled == []
