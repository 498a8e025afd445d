"""The benchmark client's arithmetic without a server: SSE chunks read with a fake clock,
metrics computed from known requests, the printed block, arrival times, and prompts of
exact token lengths from the built-in model's tokenizer."""

import asyncio
import itertools
import json
import math
import random

import pytest
from pagefleet_bench.backend import RequestOutput, read_stream
from pagefleet_bench.datasets import (
    PromptShaper,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from pagefleet_bench.metrics import compute_metrics, format_result
from pagefleet_bench.runner import send_times
from pagefleet_serve.frontend.tokenizer import load_tokenizer


class FakeClock:
    """Returns the given times in order, one per call."""

    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


async def _lines(*lines: str):
    for line in lines:
        yield line.encode()


def data(payload) -> str:
    return f"data: {json.dumps(payload)}\n"


def text_chunk(text: str) -> str:
    return data({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


def read(lines: list[str], times: list[float], start: float = 10.0) -> RequestOutput:
    output = RequestOutput(prompt_len=5, expected_output_len=3, start_time=start)
    asyncio.run(read_stream(_lines(*lines), output, FakeClock(*times)))
    return output


def test_ttft_itl_latency_and_usage_from_a_known_stream():
    chat_opening = data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    lines = [
        ": keep-alive\n",
        "\n",
        chat_opening,  # no text: not the first token
        text_chunk("Hel"),
        "\n",
        text_chunk("lo"),
        text_chunk(""),  # a finish chunk without text: no gap
        text_chunk(" you"),
        data({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}),
        "data: [DONE]\n",
    ]
    # One clock reading per data line, then one at the end of the stream.
    output = read(lines, [10.1, 10.5, 10.7, 10.75, 11.0, 11.05, 11.2])
    assert output.success and output.error == ""
    assert output.generated_text == "Hello you"
    assert output.ttft == pytest.approx(0.5)
    assert output.itl == pytest.approx([0.2, 0.3])
    assert output.latency == pytest.approx(1.2)
    assert output.output_tokens == 3


def test_chat_deltas_are_text_too():
    lines = [
        data({"choices": [{"index": 0, "delta": {"content": "a"}}]}),
        data({"choices": [{"index": 0, "delta": {"content": "b"}}]}),
    ]
    output = read(lines, [1.5, 1.75, 2.0], start=1.0)
    assert output.generated_text == "ab"
    assert (output.ttft, output.itl, output.latency) == (0.5, [0.25], 1.0)
    assert output.output_tokens is None  # no usage: counted with the tokenizer later


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        (data({"error": {"message": "engine died", "code": 500}}), "engine died"),
        ('error: {"message": "slot unavailable"}\n', "slot unavailable"),
        ("data: {not json\n", "not JSON"),
    ],
)
def test_error_events_fail_the_request_and_keep_the_reason(bad_line, expected):
    output = read([text_chunk("x"), bad_line, text_chunk("never read")], [1.0, 2.0, 3.0])
    assert not output.success
    assert expected in output.error


def test_metrics_from_known_requests():
    def done(prompt_len, tokens, ttft, itl, start, text="t"):
        latency = ttft + sum(itl)
        return RequestOutput(
            prompt_len, tokens, True, text, tokens, ttft, list(itl), latency, start
        )

    outputs = [
        done(10, 5, 0.1, [0.2, 0.2, 0.2, 0.2], start=0.0),
        done(20, 3, 0.3, [0.1, 0.1], start=0.5),
        RequestOutput(30, 4, success=False, error="HTTP 500: boom", start_time=0.6),
        RequestOutput(40, 4, success=False, error="HTTP 500: boom", start_time=0.7),
        # No usage: its text is counted with count_tokens (one token per character here).
        done(5, None, 0.2, [0.4], start=1.0, text="abcd"),
    ]
    result = compute_metrics(outputs, duration=2.0, count_tokens=len, percentiles=(50.0, 99.0))
    assert (result["completed"], result["failed"], result["incomplete"]) == (3, 2, 0)
    assert result["total_input_tokens"] == 35
    assert result["total_output_tokens"] == 5 + 3 + 4
    assert result["request_throughput"] == pytest.approx(1.5)
    assert result["output_throughput"] == pytest.approx(6.0)
    assert result["total_token_throughput"] == pytest.approx(23.5)
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["p50_ttft_ms"] == pytest.approx(200.0)
    assert result["p99_ttft_ms"] == pytest.approx(298.0)  # linear between 200 and 300
    # TPOT = (latency - ttft) / (tokens - 1): 0.8/4, 0.2/2, 0.4/3
    assert result["mean_tpot_ms"] == pytest.approx((200 + 100 + 400 / 3) / 3)
    assert result["mean_itl_ms"] == pytest.approx(1000 * 1.4 / 7)
    assert result["mean_e2el_ms"] == pytest.approx((900 + 500 + 600) / 3)
    assert result["std_e2el_ms"] == pytest.approx(
        math.sqrt(((900 - 666.67) ** 2 + (500 - 666.67) ** 2 + (600 - 666.67) ** 2) / 3), rel=1e-3
    )
    assert result["max_concurrent_requests"] == 2  # [0, 0.9], [0.5, 1.0], [1.0, 1.6]
    assert result["output_lens"] == [5, 3, 0, 0, 4]
    assert result["errors"] == ["", "", "HTTP 500: boom", "HTTP 500: boom", ""]
    assert result["error_counts"] == {"HTTP 500: boom": 2}


def test_incomplete_requests_count_their_tokens_but_not_their_latency():
    cut = RequestOutput(7, 50, generated_text="abc", ttft=0.5, itl=[0.1, 0.1], incomplete=True)
    ok = RequestOutput(3, 2, True, "xy", 2, 0.2, [0.3], 0.5)
    result = compute_metrics([ok, cut], duration=1.0, count_tokens=len)
    assert (result["completed"], result["failed"], result["incomplete"]) == (1, 0, 1)
    assert result["total_output_tokens"] == 2 + 3
    assert result["total_input_tokens"] == 3
    assert result["mean_ttft_ms"] == pytest.approx(200.0)


def test_all_failed_gives_zeros_not_errors():
    result = compute_metrics([RequestOutput(3, 2, error="x")], duration=1.0, count_tokens=len)
    assert result["completed"] == 0 and result["failed"] == 1
    assert result["mean_ttft_ms"] == 0.0 and result["output_throughput"] == 0.0


def test_result_block_has_vllms_lines():
    outputs = [RequestOutput(10, 2, True, "ab", 2, 0.1, [0.05], 0.15, 0.0)]
    result = compute_metrics(outputs, 1.0, len) | {"max_concurrency": 4, "request_rate": 2.0}
    block = format_result(result)
    lines = block.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for label in (
        "Successful requests:",
        "Failed requests:",
        "Maximum request concurrency:",
        "Request rate configured (RPS):",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Peak output token throughput (tok/s):",
        "Peak concurrent requests:",
        "Total Token throughput (tok/s):",
        "Mean TTFT (ms):",
        "P99 TPOT (ms):",
        "Median ITL (ms):",
        "P99 E2EL (ms):",
    ):
        assert any(line.startswith(label) for line in lines), label
    assert "---------------Time to First Token----------------" in lines
    assert f"{'Mean TTFT (ms):':<40} {100.0:<10.2f}" in lines


def test_send_times_poisson_and_inf():
    assert send_times(5, math.inf, 1.0, seed=0) == [0.0] * 5
    times = send_times(4000, 20.0, 1.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.05, rel=0.08)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv == pytest.approx(1.0, abs=0.1)  # exponential gaps
    steady = send_times(4000, 20.0, 16.0, seed=3)
    steady_gaps = [b - a for a, b in itertools.pairwise(steady)]
    steady_mean = sum(steady_gaps) / len(steady_gaps)
    steady_cv = math.sqrt(sum((g - steady_mean) ** 2 for g in steady_gaps) / len(steady_gaps))
    assert steady_cv / steady_mean == pytest.approx(0.25, abs=0.05)  # 1/sqrt(burstiness)
    assert send_times(10, 5.0, 1.0, seed=1) == send_times(10, 5.0, 1.0, seed=1)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin://smollm2-135m")


@pytest.mark.parametrize("chat", [False, True])
def test_random_prompts_have_exact_token_counts(tokenizer, chat):
    shaper = PromptShaper(tokenizer, chat=chat)
    samples = random_requests(shaper, 12, 64, 16, 0.5, random.Random(0))
    for sample in samples:
        assert 32 <= sample.prompt_len <= 96 and 8 <= sample.expected_output_len <= 24
        assert shaper.count(sample.prompt) == sample.prompt_len
    assert len({s.prompt_len for s in samples}) > 1
    again = random_requests(shaper, 12, 64, 16, 0.5, random.Random(0))
    assert [s.prompt for s in again] == [s.prompt for s in samples]


@pytest.mark.parametrize("chat", [False, True])
def test_prefix_repetition_shares_exact_prefixes(tokenizer, chat):
    shaper = PromptShaper(tokenizer, chat=chat)
    samples = prefix_repetition_requests(shaper, 9, 48, 16, 3, 4, random.Random(1))
    assert sorted(s.prefix_id for s in samples) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for prefix_id in range(3):
        group = [s for s in samples if s.prefix_id == prefix_id]
        if chat:
            assert len({s.system for s in group}) == 1
            assert all(shaper.count(s.prompt, s.system) == s.prompt_len for s in group)
        else:
            token_lists = [shaper.encode(s.prompt) for s in group]
            assert all(ids[:47] == token_lists[0][:47] for ids in token_lists)
            assert all(
                len(ids) == 64 == s.prompt_len for ids, s in zip(token_lists, group, strict=True)
            )
    assert len({s.prompt for s in samples}) == 9


def test_sharegpt_takes_first_turns_and_skips_short_ones(tokenizer, tmp_path):
    long_reply = "word " * 30
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": "Tell me about the sea, please."},
                {"from": "gpt", "value": long_reply},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long_reply}]},
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
        {
            "conversations": [
                {"from": "human", "value": "What is a paged KV cache?"},
                {"from": "gpt", "value": long_reply},
                {"from": "human", "value": "x"},
            ]
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    shaper = PromptShaper(tokenizer, chat=False)
    samples = sharegpt_requests(shaper, path, 2, random.Random(0))
    assert sorted(s.prompt for s in samples) == [
        "Tell me about the sea, please.",
        "What is a paged KV cache?",
    ]
    assert all(s.expected_output_len == len(shaper.encode(long_reply)) for s in samples)
    assert all(s.prompt_len == shaper.count(s.prompt) for s in samples)
    with pytest.raises(ValueError, match="only 2 usable conversations"):
        sharegpt_requests(shaper, path, 3, random.Random(0))
