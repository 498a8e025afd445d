"""The quantized cache and the Triton backend inside the engine, on the tiny random model
(token-id prompts, no tokenizer); a Gemma 2 model (sliding window, soft-capping) on every
backend against transformers."""

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.attention import get_kernel_backend
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.model.loader.model_loader import TINY_CONFIG
from pagefleet_serve.sampling_params import sample_seed

from tests.engine.test_engine_architectures import ARCHITECTURES, build, load, reference_tokens
from tests.engine.test_engine_architectures import PROMPTS as LONG_PROMPTS

PROMPTS = [list(range(1, 31)), [100, 200, 300, 5], [7] * 40 + [9, 11, 13]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
BUDGET = 1 << 20  # kv_cache_memory_bytes


def make(**config) -> LLM:
    # float32 everywhere (CUDA would default to bfloat16): exact comparisons across backends.
    return LLM(
        "builtin://tiny-random",
        dtype="float32",
        kv_cache_memory_bytes=BUDGET,
        max_model_len=512,
        **config,
    )


def generate(llm: LLM, prompts=PROMPTS, params=GREEDY):
    outputs = llm.generate(prompts, params)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.block_manager.check_no_leaks()
    return [out.outputs for out in outputs]


@pytest.fixture(scope="module")
def unquantized():
    return generate(make())


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_cache_end_to_end(kv_cache_dtype, unquantized):
    llm = make(kv_cache_dtype=kv_cache_dtype)
    c = TINY_CONFIG
    # K and V: head_dim one-byte codes plus a 4-byte scale per token and KV head, vs 4-byte
    # floats: 3.2x the blocks at the tiny model's head_dim 16 (3.8x at 64, 1.9x at 128 vs bf16).
    per_block = 2 * c.num_layers * 16 * c.num_kv_heads * (c.head_dim + 4)
    assert llm.engine.runner.bytes_per_block == per_block
    assert llm.engine.block_manager.num_blocks == BUDGET // per_block
    float32_blocks = BUDGET // (2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4)
    assert llm.engine.block_manager.num_blocks / float32_blocks > 3.1
    outputs = generate(llm)
    for got, want in zip(outputs, unquantized, strict=True):
        assert len(got[0].token_ids) == GREEDY.max_tokens
        # The prompt's logits come from attention over the quantized prompt: the first
        # token agrees, with nearly the same logprob.
        assert got[0].token_ids[0] == want[0].token_ids[0]
        assert abs(got[0].logprobs[0].logprob - want[0].logprobs[0].logprob) < 0.05


def test_block_copy_on_write_copies_the_scales():
    """The samples of an n=2 request share the prompt's partial last block; the first to
    write gets a copy (scales included). Each must continue exactly like a lone request
    with its seed (`sample_seed(seed, index)`)."""
    llm = make(kv_cache_dtype="int8")
    prompt = list(range(3, 27))  # 24 tokens: the last block is partial, so it is copied
    params = dict(max_tokens=10, temperature=1.0, ignore_eos=True, logprobs=0)
    pair = generate(llm, [prompt], SamplingParams(n=2, seed=7, **params))[0]
    for index in range(2):
        alone = generate(llm, [prompt], SamplingParams(n=1, seed=sample_seed(7, index), **params))[
            0
        ][0]
        assert pair[index].token_ids == alone.token_ids
        # The tiny model's tokens barely depend on attention; its logprobs do.
        for got, want in zip(pair[index].logprobs, alone.logprobs, strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


# The quantized caches' Triton kernels (int8, fp8) are each compared with the torch backend
# in test_kernels_attention (decode, prefill, mixed batches, block sizes); in the engine,
# under the interpreter, they cost about two minutes here: `make test-kernels` runs them.
@pytest.mark.parametrize(
    "kv_cache_dtype",
    [
        "auto",
        pytest.param("int8", marks=pytest.mark.slow),
        pytest.param("fp8", marks=pytest.mark.slow),
    ],
)
def test_triton_backend_generates_what_the_torch_backend_does(kv_cache_dtype):
    outputs = {}
    for backend in ("torch", "triton"):
        llm = make(kv_cache_dtype=kv_cache_dtype, attention_backend=backend)
        outputs[backend] = [o[0].token_ids for o in generate(llm, PROMPTS[:2])]
    assert outputs["triton"] == outputs["torch"]


def test_config_and_backend_choices(monkeypatch):
    for field, bad in (("kv_cache_dtype", "fp16"), ("attention_backend", "flash")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: bad})
    cpu = torch.device("cpu")
    from pagefleet_kernels import cpu_attention

    expected = "cpu" if cpu_attention.available() else "torch"
    assert get_kernel_backend("auto", cpu).name == expected
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_kernel_backend("triton", cpu)


# The Triton kernel's window and cap are compared with the torch backend's in
# test_kernels_attention (test_sliding_window_and_softcap_match_the_torch_backend, tiles
# before the window never read); the whole model under the interpreter (about 1.5 minutes
# here) runs in `make test-kernels`.
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_window_and_softcap_model_on_every_backend(backend, tmp_path):
    """Gemma 2 (sliding and global layers, soft-capped attention) on prompts longer than
    its window, prefill chunks mixed with decodes: each backend's greedy tokens equal
    transformers'. (`auto` on this CPU is the C++ kernel: test_engine_architectures.)"""
    family, extra = ARCHITECTURES["gemma2"]
    reference = build(family, extra, tmp_path)
    llm = load(
        tmp_path,
        attention_backend=backend,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = LONG_PROMPTS[:2]
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.outputs[0].token_ids == reference_tokens(reference, prompt)[:24], backend
