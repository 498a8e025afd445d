"""The C++ CPU attention kernel (reads K/V in place from the block pool) against the torch
backend on the same cache and against the naive per-sequence loop over the raw K/V:
decode, prefill chunks, mixed batches, GQA 1/3/8, block sizes 16 and 32, int8/fp8 caches,
contexts crossing many blocks, sliding windows and soft-capping."""

import pytest
import torch
from pagefleet_kernels import cpu_attention, torch_attention
from pagefleet_serve import LLM, SamplingParams

from tests.kernels.kernel_batches import (
    KERNEL_TOLERANCE,
    QUANTIZATION_TOLERANCE,
    make_batch,
    naive_attention,
)

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="no C++ compiler: the engine uses the torch backend"
)

BATCHES = {  # (query_lens, context_lens)
    "decode": ([1, 1, 1, 1], [1, 17, 100, 300]),
    "prefill": ([37, 16], [37, 16]),
    "mixed": ([1, 9, 1, 40], [33, 120, 16, 300]),
    "many-blocks": ([1, 3], [1500, 1100]),
}
GQA = [(4, 4), (6, 2), (8, 1)]


def assert_matches_torch_backend_and_naive_loop(batch, cache: str) -> None:
    """The kernel against the torch backend on the same cache, and against the naive loop
    over the raw K/V (within the cache's quantization error when it is int8/fp8)."""
    actual = batch.attention(cpu_attention)
    atol, rtol = KERNEL_TOLERANCE[torch.float32]
    torch.testing.assert_close(actual, batch.attention(torch_attention), atol=atol, rtol=rtol)
    if cache != "auto":
        atol, rtol = QUANTIZATION_TOLERANCE[cache]
    torch.testing.assert_close(actual, naive_attention(batch), atol=atol, rtol=rtol)


@pytest.mark.parametrize("cache", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("layout", BATCHES)
def test_cpu_kernel_matches_torch_backend_and_naive_loop(layout, heads, block_size, cache):
    query_lens, context_lens = BATCHES[layout]
    batch = make_batch(query_lens, context_lens, *heads, block_size=block_size, cache=cache)
    assert_matches_torch_backend_and_naive_loop(batch, cache)


# Head sizes with register-resident inner loops (64, 80, 96, 128, 256: AVX2 code on a CPU
# without AVX-512, 16-wide vector types with it) and one without (40); a decode
# batch wide enough for one work item per token (all KV heads of a key read as one run),
# and one so narrow that each KV head is its own item.
@pytest.mark.parametrize("cache", ["auto", "int8"])
@pytest.mark.parametrize("head_dim", [40, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("num_decode_rows", [2, 64])
def test_cpu_kernel_head_sizes_and_work_splits(head_dim, num_decode_rows, cache):
    context_lens = [1 + (37 * i) % 90 for i in range(num_decode_rows)]
    batch = make_batch(
        [1] * num_decode_rows, context_lens, 6, 2, head_dim=head_dim, cache=cache, seed=head_dim
    )
    assert_matches_torch_backend_and_naive_loop(batch, cache)


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("cache", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("context_len", [1, 16, 17, 300, 1500])
def test_cpu_kernel_cuts_a_lone_decode_rows_context_between_threads(
    context_len, heads, cache, threads
):
    """A decode batch of one has fewer (token, KV head) items than twice the threads: each
    item's context is then cut into runs of whole blocks, attended on their own and merged
    by their softmax sums (runs past a short context are empty). Against the torch backend
    and the naive loop, with a sliding window too (the runs cover only the window)."""
    batch = make_batch([1], [context_len], *heads, cache=cache, seed=context_len)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_matches_torch_backend_and_naive_loop(batch, cache)
        for window in (5, 40):
            torch.testing.assert_close(
                batch.attention(cpu_attention, sliding_window=window),
                batch.attention(torch_attention, sliding_window=window),
                atol=1e-4,
                rtol=1e-4,
            )
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("sliding_window", "softcap"), [(7, None), (None, 5.0), (20, 30.0)])
def test_cpu_kernel_sliding_window_and_softcap(sliding_window, softcap):
    batch = make_batch([1, 12, 1], [40, 50, 3], 6, 2)
    kwargs = {"sliding_window": sliding_window, "softcap": softcap}
    torch.testing.assert_close(
        batch.attention(cpu_attention, **kwargs),
        batch.attention(torch_attention, **kwargs),
        atol=1e-4,
        rtol=1e-4,
    )


@pytest.mark.parametrize("cache", ["auto", "int8"])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("layout", BATCHES)
def test_cpu_kernel_attention_sinks(layout, sliding_window, cache):
    """gpt-oss's sinks (one more logit per head in each softmax, with no value) against
    the torch backend, and against the naive loop without a window."""
    query_lens, context_lens = BATCHES[layout]
    batch = make_batch(query_lens, context_lens, 6, 2, cache=cache)
    sinks = torch.tensor([-30.0, -1.0, 0.0, 0.5, 2.0, 6.0])
    kwargs = {"sliding_window": sliding_window, "sinks": sinks}
    actual = batch.attention(cpu_attention, **kwargs)
    atol, rtol = KERNEL_TOLERANCE[torch.float32]
    torch.testing.assert_close(
        actual, batch.attention(torch_attention, **kwargs), atol=atol, rtol=rtol
    )
    if sliding_window is None:
        if cache != "auto":
            atol, rtol = QUANTIZATION_TOLERANCE[cache]
        torch.testing.assert_close(actual, naive_attention(batch, sinks), atol=atol, rtol=rtol)
    assert not torch.allclose(actual, batch.attention(cpu_attention, sliding_window=sliding_window))


def test_cpu_kernel_bfloat16_query_and_cache():
    batch = make_batch([1, 5], [30, 70], 6, 2, dtype=torch.bfloat16)
    actual = batch.attention(cpu_attention)
    assert actual.dtype == torch.bfloat16
    atol, rtol = KERNEL_TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(actual, batch.attention(torch_attention), atol=atol, rtol=rtol)


def test_engine_greedy_output_equals_the_torch_backend():
    """The built-in model, float32, continuous batching (prefills mixed with decodes)."""
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Three prime numbers greater than 50 are",
        "A paged KV cache",
    ]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(
            dtype="float32",
            attention_backend=backend,
            kv_cache_dtype="int8",
            max_model_len=256,
            kv_cache_memory_bytes=32 << 20,
        )
        outputs[backend] = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)]
    assert outputs["cpu"] == outputs["torch"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_decode_rows", [2, 64])  # per-KV-head items and whole rows
def test_cpu_kernel_16_bit_query_is_the_float32_result_rounded(dtype, num_decode_rows):
    """The kernel reads a 16-bit query itself and rounds its float32 output once: bit for
    bit what converting the query to float32 first and the output back afterwards gives."""
    batch = make_batch(
        [1] * num_decode_rows, [1 + 23 * i % 200 for i in range(num_decode_rows)], 6, 2, dtype=dtype
    )
    actual = batch.attention(cpu_attention)
    assert actual.dtype == dtype
    batch.query = batch.query.float()
    assert torch.equal(actual, batch.attention(cpu_attention).to(dtype))


def written_caches(write, key, value, slot_mapping, shape, cache_dtype):
    scaled = cache_dtype in (torch.int8, torch.float8_e4m3fn)
    caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2)]
    scales = [torch.zeros(shape[:3]) if scaled else None for _ in range(2)]
    write(key, value, *caches, slot_mapping, *scales)
    return [t.view(torch.uint8) if t.element_size() == 1 else t for t in caches] + [
        s for s in scales if s is not None
    ]


@pytest.mark.parametrize("cache", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cpu_cache_write_matches_the_torch_backend_bit_for_bit(dtype, cache):
    """K and V as the model hands them over (views into one fused qkv projection), into a
    pool of 16-slot blocks at shuffled slots; int8/fp8 caches take the torch path."""
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(40, 3, 3, 64, generator=generator).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    shape = (7, 16, 3, 64)
    slot_mapping = torch.randperm(7 * 16, generator=generator)[:40]
    cache_dtype = {"auto": dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[cache]
    args = (key, value, slot_mapping, shape, cache_dtype)
    expected = written_caches(torch_attention.write_kv_cache, *args)
    actual = written_caches(cpu_attention.write_kv_cache, *args)
    for want, got in zip(expected, actual, strict=True):
        assert torch.equal(got, want)


def test_cpu_cache_write_refuses_a_slot_outside_the_pool():
    key = value = torch.zeros(2, 3, 64)
    caches = [torch.zeros(4, 16, 3, 64) for _ in range(2)]
    with pytest.raises(RuntimeError, match="slot 64 is outside the cache"):
        cpu_attention.write_kv_cache(key, value, *caches, torch.tensor([3, 64]))
    assert not caches[0].any()  # checked before anything is written
