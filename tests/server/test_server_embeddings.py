"""/v1/embeddings on a real server on loopback, through the `openai` SDK: a tiny random
embedding checkpoint (Qwen3-Embedding's layout: the base model only, last-token pooling,
normalised, Matryoshka dimensions declared) whose vectors equal transformers' own pooling,
as floats and as base64 (the SDK's default, which it decodes), for several inputs in one
request, for concurrent requests and for an input longer than a prefill chunk; every KV
block free again afterwards. And the refusals: each task's server refuses the other's
endpoints, and bad inputs get OpenAI-style 400s."""

from __future__ import annotations

import asyncio
import base64
import struct

import httpx
import openai
import pytest

from tests.engine.embedding_models import (
    build_embedding_model,
    cosine_distance,
    reference_embeddings,
)
from tests.server.server_harness import ServerProcess, ThreadServer, assert_error, read_metrics

MAX_MODEL_LEN = 128
CHUNK = 32
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "embeddings " * 20]
LONG_IDS = [(13 * i + 1) % 4000 + 10 for i in range(2 * CHUNK + 9)]  # three chunks


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-embedding")
    return build_embedding_model(
        path, family="Qwen3", pooling="last", headless=True, matryoshka_dimensions=[16, 32, 64]
    )


@pytest.fixture(scope="module")
def server(model_path):
    running = ThreadServer(
        {"served_model_names": ("tiny-embed",)},
        model=str(model_path),
        max_num_seqs=4,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=CHUNK,
        kv_cache_memory_bytes=2 << 20,
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def references(server, model_path):
    tokenizer = server.engine.tokenizer
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    return ids, reference_embeddings(model_path, [*ids, LONG_IDS])


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def assert_close(vectors, references) -> None:
    assert len(vectors) == len(references)
    for vector, reference in zip(vectors, references, strict=True):
        assert len(vector) == reference.numel()
        assert cosine_distance(vector, reference) < 1e-5


def test_sdk_floats_and_base64_equal_transformers(server, references):
    ids, expected = references
    free = server.core.block_manager.num_free_blocks
    sdk = client(server)
    as_floats = sdk.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    assert [d.index for d in as_floats.data] == [0, 1, 2]
    assert_close([d.embedding for d in as_floats.data], expected[:3])
    num_tokens = sum(map(len, ids))
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == num_tokens
    assert as_floats.model == "tiny-embed"
    # No encoding_format: the SDK asks for base64 and decodes it itself.
    decoded = sdk.embeddings.create(model="tiny-embed", input=TEXTS)
    assert [d.embedding for d in decoded.data] == [d.embedding for d in as_floats.data]
    # base64 asked for: the SDK hands the string over; little-endian float32, as floats.
    raw = sdk.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="base64")
    packed = [base64.b64decode(d.embedding) for d in raw.data]
    assert [len(p) for p in packed] == [4 * 64] * 3
    assert [list(struct.unpack("<64f", p)) for p in packed] == [d.embedding for d in as_floats.data]
    assert server.core.block_manager.num_free_blocks == free


def test_token_ids_long_input_and_concurrent_requests(server, references):
    ids, expected = references
    free = server.core.block_manager.num_free_blocks
    before = read_metrics(server.base_url)
    sdk = client(server)
    (long,) = sdk.embeddings.create(
        model="tiny-embed", input=LONG_IDS, encoding_format="float"
    ).data
    assert_close([long.embedding], expected[3:])
    after = read_metrics(server.base_url)
    prompt = "vllm:prompt_tokens_total"  # no series before a request's first tokens
    assert after[prompt] - before.get(prompt, 0) == len(LONG_IDS)
    success = 'vllm:request_success_total{finished_reason="stop"}'
    assert after[success] - before.get(success, 0) == 1
    batch = sdk.embeddings.create(model="tiny-embed", input=[*ids, LONG_IDS]).data
    assert_close([d.embedding for d in batch], expected)

    async def concurrently():
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        ) as aclient:
            return await asyncio.gather(
                *(aclient.embeddings.create(model="tiny-embed", input=p) for p in [*ids, LONG_IDS])
            )

    answers = asyncio.run(concurrently())
    assert_close([a.data[0].embedding for a in answers], expected)
    assert server.core.block_manager.num_free_blocks == free
    assert not server.core.has_unfinished_requests()


def test_matryoshka_dimensions(server, references):
    import torch

    _, expected = references
    sdk = client(server)
    (cut,) = sdk.embeddings.create(
        model="tiny-embed", input=TEXTS[1], dimensions=16, encoding_format="float"
    ).data
    want = torch.nn.functional.normalize(expected[1][:16], dim=0)
    assert len(cut.embedding) == 16 and cosine_distance(cut.embedding, want) < 1e-5
    assert abs(sum(x * x for x in cut.embedding) - 1.0) < 1e-5
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.embeddings.create(model="tiny-embed", input="x", dimensions=24)
    assert refused.value.body["param"] == "dimensions"


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ["a", ""]}, "input", None),
        ({"input": ["a"] * 65}, "input", None),
        ({"input": [10**9]}, "input", None),
        ({"input": [[5] * (MAX_MODEL_LEN + 1)]}, "input", "context_length_exceeded"),
        ({"input": "word " * (MAX_MODEL_LEN + 10)}, "input", "context_length_exceeded"),
        ({"input": "x" * 10**6}, "input", "context_length_exceeded"),
        ({"input": 5}, "input", None),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", None),
        ({"input": "hi", "dimensions": 0}, "dimensions", None),
        ({}, "input", None),
    ],
)
def test_bad_inputs_are_400s(server, body, param, code):
    response = httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=60)
    assert_error(response, 400, code=code, param=param)


def test_the_whole_context_fits(server):
    response = httpx.post(
        f"{server.base_url}/v1/embeddings", json={"input": [7] * MAX_MODEL_LEN}, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN


def test_unknown_model_is_404(server):
    response = httpx.post(
        f"{server.base_url}/v1/embeddings", json={"model": "nope", "input": "hi"}, timeout=60
    )
    assert_error(response, 404, code="model_not_found", param="model")


def test_an_embed_model_refuses_generation(server):
    sdk = client(server)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        sdk.completions.create(model="tiny-embed", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        sdk.chat.completions.create(
            model="tiny-embed", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


def test_a_generate_model_refuses_embeddings():
    generator = ThreadServer({}, model="builtin://tiny-random", kv_cache_memory_bytes=2 << 20)
    try:
        with pytest.raises(openai.BadRequestError, match="serves no embeddings") as refused:
            client(generator).embeddings.create(model="tiny-random", input=[1, 2, 3])
        assert refused.value.body["code"] == "model_not_supported"
    finally:
        generator.stop()


def test_pagefleet_serve_with_task_embed(server, model_path):
    """The command line and the core process: `pagefleet serve --task embed`, the vector
    crossing the process boundary in the core's output message."""
    process = ServerProcess(
        "--host",
        "127.0.0.1",
        "--model",
        str(model_path),
        "--task",
        "embed",
        "--served-model-name",
        "tiny-embed",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "2MiB",
    )
    try:
        process.wait_ready()
        body = {"model": "tiny-embed", "input": TEXTS}
        answer = httpx.post(f"{process.base_url}/v1/embeddings", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        here = httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=60).json()
        for theirs, ours in zip(answer.json()["data"], here["data"], strict=True):
            assert cosine_distance(theirs["embedding"], ours["embedding"]) < 1e-6
        refused = httpx.post(
            f"{process.base_url}/v1/completions", json={"prompt": "hi"}, timeout=60
        )
        assert_error(refused, 400, code="model_not_supported", param="model")
    finally:
        process.stop()
