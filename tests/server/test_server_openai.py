"""The OpenAI API through the official `openai` SDK (sync and async) against a
`pagefleet serve` subprocess: streamed text equals the non-streamed greedy result, usage
is right, n=2, logprobs, stop strings, 32 concurrent streams with metrics read under load,
and UTF-8 that streams without replacement characters."""

import asyncio
import threading

import httpx
import openai
import pytest
from pagefleet_serve.frontend.tokenizer import load_tokenizer

from tests.server.server_harness import read_metrics, sse_events, wait_until

MODEL_NAME = "smol"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(default_pod):
    """The session's default pod: its engine settings come from the environment, as the
    operator sets them (served name "smol", 1,024 tokens, 256 MiB, 8 sequences, float32:
    some tests compare two greedy runs of one prompt token for token, and the second reuses
    the first's cached prefix, which in bfloat16 may round differently)."""
    return default_pod


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin://smollm2-135m")


def chat_prompt_tokens(tokenizer, question: str) -> int:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_startup_log_names_model_device_pool_and_address(server):
    log = server.log_text()
    for expected in (
        "model smollm2-135m",
        "device cpu",
        "KV cache pool:",
        f"serving {MODEL_NAME} on http://127.0.0.1:{server.port}",
    ):
        assert expected in log, log


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completions_stream_equals_non_stream_sync(client, tokenizer):
    prompt = "The three primary colors are"
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    num_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
    for usage in (whole.usage, chunks[-1].usage):
        assert usage.prompt_tokens == num_prompt
        assert usage.completion_tokens == len(tokenizer.encode(text, add_special_tokens=False))
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]


def test_chat_stream_equals_non_stream_async(server, tokenizer):
    async def both():
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        ) as aclient:
            whole = await aclient.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=16,
                temperature=0,
            )
            stream = await aclient.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            return whole, [chunk async for chunk in stream]

    whole, chunks = asyncio.run(both())
    assert whole.choices[0].message.role == "assistant"
    assert "Paris" in whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (
        usage.prompt_tokens == whole.usage.prompt_tokens == chat_prompt_tokens(tokenizer, QUESTION)
    )
    assert usage.completion_tokens == whole.usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert whole.choices[0].finish_reason == "stop"


def test_chat_stream_equals_non_stream_sync(client):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a primary color."},
    ]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == whole.choices[0].message.content
    )


def test_completions_async_stream_equals_non_stream(server):
    async def both():
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        ) as aclient:
            whole = await aclient.completions.create(
                model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0
            )
            stream = await aclient.completions.create(
                model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stream=True
            )
            return whole, "".join([c.choices[0].text async for c in stream])

    whole, text = asyncio.run(both())
    assert text == whole.choices[0].text
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"


def test_n2_gives_two_choices(client):
    whole = client.completions.create(
        model=MODEL_NAME,
        prompt="My favourite animal is",
        max_tokens=6,
        temperature=1.0,
        seed=7,
        n=2,
    )
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert whole.usage.completion_tokens == 12  # ignore_eos is off, but 6 tokens rarely end
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=6,
            temperature=1.0,
            seed=7,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] and texts[1]


def test_logprobs(client):
    completion = client.completions.create(
        model=MODEL_NAME, prompt="The sky is", max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 3
    assert "".join(logprobs.tokens) == completion.choices[0].text
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(3)]
    assert logprobs.text_offset == offsets
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        # Greedy: the chosen token is the most likely one, with the very same logprob.
        assert len(top) == 2 and max(top, key=top.get) == token
        assert top[token] == logprob and logprob <= 0 and min(top.values()) < logprob
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for entry in content:
        ranked = [t.logprob for t in entry.top_logprobs]
        assert len(ranked) == 3 and ranked == sorted(ranked, reverse=True)
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
    # The same token at the same position has the same logprob in both APIs.
    again = client.completions.create(
        model=MODEL_NAME, prompt="The sky is", max_tokens=1, temperature=0, logprobs=0
    )
    assert again.choices[0].logprobs.token_logprobs[0] == pytest.approx(
        logprobs.token_logprobs[0], abs=1e-5
    )


def test_max_completion_tokens_wins_over_max_tokens(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=9,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 4


def test_choices_of_several_prompts_with_n_are_numbered_prompt_major(client):
    prompts = ["The capital of Italy is", "Water boils at"]
    alone = [
        client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    whole = client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=4, temperature=0, n=2
    )
    # OpenAI's numbering: choice index = prompt index x n + sample index.
    assert [(c.index, c.text) for c in whole.choices] == [
        (0, alone[0]),
        (1, alone[0]),
        (2, alone[1]),
        (3, alone[1]),
    ]
    streamed = {i: "" for i in range(4)}
    for chunk in client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=4, temperature=0, n=2, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == {c.index: c.text for c in whole.choices}


def test_stop_string_ends_the_text_and_is_never_streamed(client):
    body = {"model": MODEL_NAME, "prompt": "1, 2, 3, 4,", "max_tokens": 16, "temperature": 0}
    whole = client.completions.create(**body, stop=[" 7"])
    pieces, reasons = [], []
    for chunk in client.completions.create(**body, stop=[" 7"], stream=True):
        for choice in chunk.choices:
            pieces.append(choice.text)
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == whole.choices[0].text and whole.choices[0].text.startswith(" 5")
    assert reasons[-1] == "stop" and set(reasons[:-1]) <= {None}
    assert whole.choices[0].finish_reason == "stop" and "7" not in "".join(pieces)


def test_utf8_streams_without_replacement_characters(server, client):
    messages = [{"role": "user", "content": "用一句话介绍一下长城。"}]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0
    )
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        raw = b"".join(response.iter_bytes())
    events = sse_events(raw.decode("utf-8").splitlines())
    assert events[-1] == "DONE"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert "\ufffd" not in text and any(ord(ch) > 127 for ch in text)
    assert text == whole.choices[0].message.content


# -- 32 concurrent streams, with /metrics read while they run ---------------------------------
NUM_CONCURRENT = 32


@pytest.fixture(scope="module")
def burst(server, client):
    """32 streaming completions at once on a server with max_num_seqs=8, /metrics polled
    throughout; also the same prompts' non-streamed greedy results, as one batch request."""
    prompts = [f"Count upwards: {i}, {i + 1}, {i + 2}," for i in range(NUM_CONCURRENT)]
    expected = client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0
    )
    before = read_metrics(server.base_url)
    waiting_seen = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            waiting_seen.append(read_metrics(server.base_url)["vllm:num_requests_waiting"])

    async def one(aclient, prompt: str) -> str:
        stream = await aclient.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def all_streams() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        texts = asyncio.run(all_streams())
    finally:
        stop.set()
        poller.join()
    after = read_metrics(server.base_url)
    return {
        "expected": [c.text for c in sorted(expected.choices, key=lambda c: c.index)],
        "texts": texts,
        "waiting_seen": waiting_seen,
        "before": before,
        "after": after,
    }


def test_32_concurrent_streams_complete_uninterleaved(burst):
    assert len(burst["texts"]) == NUM_CONCURRENT
    assert burst["texts"] == burst["expected"]
    assert len(set(burst["texts"])) > NUM_CONCURRENT // 2  # distinct prompts, distinct texts


def test_metrics_under_load(server, burst):
    assert max(burst["waiting_seen"]) > 0, burst["waiting_seen"]
    before, after = burst["before"], burst["after"]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    finished = sum(
        delta(f'vllm:request_success_total{{finished_reason="{r}"}}') for r in ("stop", "length")
    )
    assert finished == NUM_CONCURRENT
    assert delta("vllm:time_to_first_token_seconds_count") == NUM_CONCURRENT
    assert delta("vllm:e2e_request_latency_seconds_count") == NUM_CONCURRENT
    assert delta("vllm:request_queue_time_seconds_count") == NUM_CONCURRENT
    assert delta("vllm:generation_tokens_total") == NUM_CONCURRENT * 6
    assert delta("vllm:inter_token_latency_seconds_count") == NUM_CONCURRENT * 5
    assert delta("vllm:prompt_tokens_total") > 0
    assert delta("vllm:prefix_cache_queries_total") > 0
    idle = wait_until(
        lambda: (m := read_metrics(server.base_url))["vllm:num_requests_running"] == 0 and m,
        30,
        "the engine to go idle",
    )
    assert idle["vllm:kv_cache_usage_perc"] == 0.0
    assert idle["vllm:num_requests_waiting"] == 0.0
