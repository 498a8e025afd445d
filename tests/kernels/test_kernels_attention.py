"""Paged attention: the Triton kernel against the torch backend, the torch backend against
a naive per-sequence loop over the raw K/V.

On the CPU the kernel runs in the Triton interpreter on small shapes (the fast set runs in
every `make test`; the full sweep is `slow`); `pytest -m gpu tests/kernels` runs the same
checks compiled, at Llama-3-8B size, on a CUDA device.
"""

import dataclasses
import itertools

import pytest
import torch
from pagefleet_kernels import torch_attention, triton_attention

from tests.kernels.conftest import requires_cuda
from tests.kernels.kernel_batches import (
    KERNEL_TOLERANCE,
    QUANTIZATION_TOLERANCE,
    PagedBatch,
    make_batch,
    naive_attention,
)

CONTEXT_LENS = [1, 15, 16, 17, 100, 300]
GQA = [(4, 4), (6, 2), (8, 1)]  # (query heads, KV heads): ratios 1, 3, 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CACHES = ["auto", "int8", "fp8"]


def check(batch: PagedBatch, cache: str, **kernel_kwargs) -> None:
    """Kernel vs the torch backend on the same cache; torch backend vs the naive loop on raw K/V."""
    expected = batch.attention(torch_attention)
    actual = batch.attention(triton_attention, **kernel_kwargs)
    atol, rtol = KERNEL_TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)
    if cache != "auto":
        atol, rtol = QUANTIZATION_TOLERANCE[cache]
        atol += KERNEL_TOLERANCE[batch.query.dtype][0]
    torch.testing.assert_close(expected.float().cpu(), naive_attention(batch), atol=atol, rtol=rtol)


# -- every CI run (interpreter on the CPU, a second or two each) ------------------------
# Every dtype with every cache once, the GQA ratio rotating; the slow sweep crosses all.
FAST_CASES = [
    pytest.param(
        GQA[i % 3], dtype, cache, id=f"gqa{GQA[i % 3][0] // GQA[i % 3][1]}-{str(dtype)[6:]}-{cache}"
    )
    for i, (dtype, cache) in enumerate(itertools.product(DTYPES, CACHES))
]


@pytest.mark.parametrize(("heads", "dtype", "cache"), FAST_CASES)
def test_decode_only(heads, dtype, cache, device):
    batch = make_batch(
        [1] * len(CONTEXT_LENS), CONTEXT_LENS, *heads, dtype=dtype, cache=cache, device=device
    )
    check(batch, cache)


@pytest.mark.parametrize(("heads", "dtype", "cache"), FAST_CASES)
def test_prefill_only(heads, dtype, cache, device):
    # Whole prompts and chunks continuing a cached context.
    query_lens = [15, 16, 17, 100, 2, 40]
    context_lens = [15, 16, 17, 100, 17, 300]
    batch = make_batch(query_lens, context_lens, *heads, dtype=dtype, cache=cache, device=device)
    check(batch, cache)


@pytest.mark.parametrize(("heads", "dtype", "cache"), FAST_CASES)
def test_mixed_decodes_and_prefill_chunks(heads, dtype, cache, device):
    query_lens = [1, 17, 1, 5, 1, 33, 1, 1]
    context_lens = [300, 17, 16, 100, 1, 300, 15, 17]
    batch = make_batch(query_lens, context_lens, *heads, dtype=dtype, cache=cache, device=device)
    check(batch, cache)


@pytest.mark.parametrize("batch_size", range(1, 9))
def test_decode_batch_sizes(batch_size, device):
    contexts = list(itertools.islice(itertools.cycle(CONTEXT_LENS[::-1]), batch_size))
    batch = make_batch(
        [1] * batch_size,
        contexts,
        6,
        2,
        dtype=torch.float16,
        cache="int8",
        device=device,
        seed=batch_size,
    )
    check(batch, "int8")


@pytest.mark.parametrize(
    ("context_lens", "num_calls"),
    [
        ([7 + (i * 37) % 610 for i in range(70)], 4),  # spread: several length buckets
        ([300 + i % 3 for i in range(70)], 1),  # alike: the buckets merge into one call
        ([5] * 60 + [600] * 10, 2),  # two groups: two calls
    ],
    ids=["spread", "alike", "two-groups"],
)
def test_torch_backend_decode_length_buckets(context_lens, num_calls):
    buckets = torch_attention._decode_buckets(
        torch.argsort(torch.tensor(context_lens)), sorted(context_lens)
    )
    assert len(buckets) == num_calls
    rows = torch.cat([rows for rows, _ in buckets])
    assert sorted(rows.tolist()) == list(range(len(context_lens)))  # each row exactly once
    for rows, longest in buckets:
        assert longest == max(context_lens[i] for i in rows.tolist())
    batch = make_batch([1] * len(context_lens), context_lens, 6, 2, dtype=torch.float32)
    torch.testing.assert_close(
        batch.attention(torch_attention), naive_attention(batch), atol=1e-4, rtol=1e-4
    )


def test_torch_backend_plan_cache_is_reused_across_layers():
    # Two "layers": the same batch layout, different queries and caches.
    query_lens, context_lens = [1, 17, 1, 5, 1, 33], [300, 17, 16, 100, 1, 300]
    first_layer = make_batch(query_lens, context_lens, 6, 2, seed=1)
    layers = [
        first_layer,
        dataclasses.replace(
            first_layer,
            query=first_layer.query.flip(-1),
            key_cache=-first_layer.key_cache,
            value_cache=2 * first_layer.value_cache,
        ),
    ]
    plan_cache: dict = {}
    first = layers[0].attention(torch_attention, plan_cache=plan_cache)
    plan = plan_cache["torch"]
    second = layers[1].attention(torch_attention, plan_cache=plan_cache)
    assert plan_cache["torch"] is plan  # built once
    assert len(plan.decodes) == 1 and len(plan.prefills) == 3
    torch.testing.assert_close(first, layers[0].attention(torch_attention), atol=0, rtol=0)
    torch.testing.assert_close(second, layers[1].attention(torch_attention), atol=0, rtol=0)


@pytest.mark.parametrize("num_segments", [1, 2, 4, 16])
@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_decode_split_over_context_segments(num_segments, cache, device):
    # 16 segments of a 17-token context leave most segments empty.
    batch = make_batch(
        [1, 1, 1, 1], [300, 17, 1, 100], 8, 2, dtype=torch.float32, cache=cache, device=device
    )
    check(batch, cache, num_segments=num_segments)


# (sliding_window, softcap): a window shorter than a tile, one spanning several, one longer
# than most contexts; Gemma 2's cap 50 and a cap that bends most scores.
WINDOW_SOFTCAP = [(7, None), (40, None), (None, 0.5), (20, 50.0), (1000, 0.5)]


@pytest.mark.parametrize(("sliding_window", "softcap"), WINDOW_SOFTCAP)
@pytest.mark.parametrize(
    ("query_lens", "context_lens", "num_segments"),
    [
        ([1] * len(CONTEXT_LENS), CONTEXT_LENS, None),
        ([1, 1, 1, 1], [300, 17, 1, 100], 4),  # decode split over segments
        ([1, 17, 1, 5, 1, 33, 1, 1], [300, 17, 16, 100, 1, 300, 15, 17], None),
    ],
    ids=["decode", "decode-segments", "mixed"],
)
def test_sliding_window_and_softcap_match_the_torch_backend(
    query_lens, context_lens, num_segments, sliding_window, softcap, device
):
    batch = make_batch(query_lens, context_lens, 6, 2, dtype=torch.float32, device=device)
    kwargs = {"sliding_window": sliding_window, "softcap": softcap}
    expected = batch.attention(torch_attention, **kwargs)
    actual = batch.attention(triton_attention, num_segments=num_segments, **kwargs)
    atol, rtol = KERNEL_TOLERANCE[torch.float32]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    # Both differ from plain attention: the window and the cap are really applied.
    assert not torch.allclose(expected, batch.attention(torch_attention), atol=1e-3)


@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize(
    ("query_lens", "context_lens", "num_segments"),
    [
        ([1] * len(CONTEXT_LENS), CONTEXT_LENS, None),
        ([1, 1, 1, 1], [300, 17, 1, 100], 4),  # the merge kernel adds the sink
        ([1, 17, 1, 5, 1, 33], [300, 17, 16, 100, 1, 300], None),
    ],
    ids=["decode", "decode-segments", "mixed"],
)
def test_attention_sinks_match_the_torch_backend_and_the_naive_loop(
    query_lens, context_lens, num_segments, sliding_window, device
):
    """gpt-oss's sinks: one more logit per query head in each softmax, with no value. Sinks
    from very negative (no effect) to large (most of the weight) on different heads."""
    batch = make_batch(query_lens, context_lens, 6, 2, dtype=torch.float32, device=device)
    sinks = torch.tensor([-30.0, -1.0, 0.0, 0.5, 2.0, 6.0], device=device)
    kwargs = {"sliding_window": sliding_window, "sinks": sinks}
    expected = batch.attention(torch_attention, **kwargs)
    actual = batch.attention(triton_attention, num_segments=num_segments, **kwargs)
    atol, rtol = KERNEL_TOLERANCE[torch.float32]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    if sliding_window is None:
        torch.testing.assert_close(
            expected.cpu(), naive_attention(batch, sinks), atol=atol, rtol=rtol
        )
    # The sinks are really applied: the head whose sink is 6 is scaled far down.
    plain = batch.attention(torch_attention, sliding_window=sliding_window)
    assert not torch.allclose(expected[:, 5], plain[:, 5], atol=1e-3)
    torch.testing.assert_close(expected[:, 0], plain[:, 0], atol=1e-5, rtol=1e-5)


def test_sliding_window_tiles_before_the_window_are_not_read(device):
    """K/V of whole tiles before every query's window hold NaN: reading one would poison
    the output, so the kernel must skip them rather than mask them."""
    batch = make_batch([1, 9], [300, 200], 6, 2, dtype=torch.float32, block_size=16, device=device)
    window = 40
    poisoned = []
    for i, (q_len, ctx) in enumerate(zip(batch.query_lens, batch.seq_lens.tolist(), strict=True)):
        first_tile = (ctx - q_len - window + 1) // 64  # the widest tile the kernel uses
        poisoned += batch.block_tables[i, : first_tile * 64 // 16].tolist()
    assert poisoned
    expected = batch.attention(torch_attention, sliding_window=window)
    batch.key_cache[poisoned] = float("nan")
    batch.value_cache[poisoned] = float("nan")
    actual = batch.attention(triton_attention, sliding_window=window)
    atol, rtol = KERNEL_TOLERANCE[torch.float32]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 128), (32, 64), (32, 128)])
@pytest.mark.parametrize("cache", ["auto", "int8"])
def test_block_sizes_and_head_dims(block_size, head_dim, cache, device):
    batch = make_batch(
        [1, 20, 1],
        [100, 40, 33],
        6,
        2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
        cache=cache,
        device=device,
    )
    check(batch, cache)


def test_head_dim_that_is_not_a_power_of_two(device):
    batch = make_batch([1, 9], [40, 30], 4, 2, head_dim=80, dtype=torch.float16, device=device)
    check(batch, "auto")


def test_launcher_rejects_mismatched_shapes(device):
    batch = make_batch([1, 3], [20, 20], 4, 2, cache="int8", device=device)
    with pytest.raises(ValueError, match="key_scale"):
        dataclasses.replace(batch, key_scale=None, value_scale=None).attention(triton_attention)
    with pytest.raises(ValueError, match="multiple"):
        dataclasses.replace(batch, query=batch.query[:, :3]).attention(triton_attention)
    with pytest.raises(ValueError, match="query_lens"):
        dataclasses.replace(batch, query_lens=[2, 3]).attention(triton_attention)
    with pytest.raises(ValueError, match="decode-only"):
        batch.attention(triton_attention, num_segments=2)


# -- the full sweep (`make test-kernels`) ------------------------------------------------
def _sweep_cases():
    shapes = [  # (query_lens, context_lens)
        ([1] * 8, [1, 15, 16, 17, 100, 300, 300, 17]),
        (CONTEXT_LENS, CONTEXT_LENS),
        ([1, 15, 1, 100, 1, 17, 3], [1, 300, 16, 100, 300, 17, 17]),
    ]
    for (q, c), heads, dtype, cache, block_size, head_dim in itertools.product(
        shapes, GQA, DTYPES, CACHES, (16, 32), (64, 128)
    ):
        yield pytest.param(
            q,
            c,
            heads,
            dtype,
            cache,
            block_size,
            head_dim,
            id=f"{'decode' if max(q) == 1 else 'mixed' if 1 in q else 'prefill'}"
            f"-gqa{heads[0] // heads[1]}-{str(dtype)[6:]}-{cache}"
            f"-bs{block_size}-d{head_dim}",
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("query_lens", "context_lens", "heads", "dtype", "cache", "block_size", "head_dim"),
    list(_sweep_cases()),
)
def test_sweep(query_lens, context_lens, heads, dtype, cache, block_size, head_dim, device):
    batch = make_batch(
        query_lens,
        context_lens,
        *heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        cache=cache,
        device=device,
    )
    check(batch, cache)


# -- full size on a GPU (`pytest -m gpu tests/kernels`) ---------------------------------
LLAMA3_8B = (32, 8)  # query heads, KV heads; head_dim 128


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([1] * 64, [4096] * 64),
        ([1] * 4, [32768, 17, 1000, 4097]),
        ([1] * 16 + [512, 1000], [2000] * 16 + [512, 5000]),
        ([2048], [8192]),
    ],
    ids=["decode64x4k", "decode-long", "mixed", "prefill-chunk"],
)
def test_gpu_full_size(query_lens, context_lens, dtype, cache, device):
    batch = make_batch(
        query_lens, context_lens, *LLAMA3_8B, head_dim=128, dtype=dtype, cache=cache, device=device
    )
    expected = batch.attention(torch_attention)
    actual = batch.attention(triton_attention)
    atol, rtol = KERNEL_TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("cache", ["auto", "int8"])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(4096, None), (4096, 50.0), (None, 50.0)])
def test_gpu_gemma2_window_and_softcap(sliding_window, softcap, cache, device):
    """Gemma 2 9B's attention (16 query heads, 8 KV heads, head_dim 256) compiled: decodes
    and prefill chunks past its 4096-token window, with and without its cap of 50."""
    batch = make_batch(
        [1] * 16 + [512, 1000],
        [8000] * 16 + [512, 9000],
        16,
        8,
        head_dim=256,
        dtype=torch.bfloat16,
        cache=cache,
        device=device,
    )
    kwargs = {"sliding_window": sliding_window, "softcap": softcap}
    atol, rtol = KERNEL_TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(
        batch.attention(triton_attention, **kwargs).float(),
        batch.attention(torch_attention, **kwargs).float(),
        atol=atol,
        rtol=rtol,
    )


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([1] * len(CONTEXT_LENS), CONTEXT_LENS),
        (CONTEXT_LENS, CONTEXT_LENS),
    ],
)
def test_gpu_sweep_fp32(query_lens, context_lens, cache, device):
    for heads in GQA:
        check(
            make_batch(
                query_lens, context_lens, *heads, dtype=torch.float32, cache=cache, device=device
            ),
            cache,
        )


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("cache", ["auto", "int8"])
def test_gpu_block_offsets_beyond_int32(cache, device):
    """Blocks past 2**31 elements into the pool: every offset must be computed in 64 bits."""
    small = make_batch(
        [1, 7], [300, 40], *LLAMA3_8B, head_dim=128, dtype=torch.float16, cache=cache, device=device
    )
    per_block = small.key_cache[0].numel()  # elements
    shift = 2**31 // per_block + 8
    num_blocks = shift + small.key_cache.shape[0]

    def moved(pool):
        if pool is None:
            return None
        big = torch.zeros((num_blocks, *pool.shape[1:]), dtype=pool.dtype, device=device)
        big[shift:] = pool
        return big

    big = PagedBatch(
        **{
            **small.__dict__,
            "key_cache": moved(small.key_cache),
            "value_cache": moved(small.value_cache),
            "key_scale": moved(small.key_scale),
            "value_scale": moved(small.value_scale),
            "block_tables": small.block_tables + shift,
        }
    )
    torch.testing.assert_close(
        big.attention(triton_attention), small.attention(torch_attention), atol=2e-3, rtol=2e-3
    )
