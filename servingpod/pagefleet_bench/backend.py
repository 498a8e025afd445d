"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

The body asks for `stream: true` with `stream_options.include_usage`. TTFT is the time to
the first chunk that carries text; each later chunk with text adds one inter-token gap;
the output token count comes from the last `usage` seen (a server that sends none gets
its text counted with the tokenizer later). A non-200 status, an error event in the
stream or a broken connection fails the request and keeps the reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field

import aiohttp

from pagefleet_bench.datasets import SampleRequest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
Clock = Callable[[], float]


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run shares."""

    base_url: str
    endpoint: str
    model: str
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    api_key: str | None = None

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


@dataclass
class RequestOutput:
    prompt_len: int
    expected_output_len: int
    success: bool = False
    generated_text: str = ""
    output_tokens: int | None = None  # from usage; None until a server reports it
    ttft: float = 0.0  # seconds from sending to the first text
    itl: list[float] = field(default_factory=list)  # gaps between later text chunks
    latency: float = 0.0  # seconds from sending to the end of the stream
    start_time: float = 0.0  # clock value when the request was sent
    error: str = ""
    incomplete: bool = False  # cut off by the run's duration limit (neither done nor failed)


def request_body(settings: RequestSettings, sample: SampleRequest) -> dict:
    body: dict = {
        "model": settings.model,
        "max_tokens": sample.expected_output_len,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.endpoint == "/v1/chat/completions":
        messages = [{"role": "system", "content": sample.system}] if sample.system else []
        body["messages"] = [*messages, {"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if settings.ignore_eos:
        body["ignore_eos"] = True
    return body | settings.extra_body


def _chunk_text(choice: dict) -> str:
    if "text" in choice:  # completions
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def read_stream(
    lines: AsyncIterable[bytes], output: RequestOutput, clock: Clock = time.perf_counter
) -> None:
    """Fill `output` from SSE lines as they arrive; `output.start_time` is already set."""
    last = output.start_time
    async for raw in lines:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line or line.startswith(":"):
            continue  # event separator or keep-alive comment
        if line.startswith("error:"):
            output.error = line
            return
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            break
        now = clock()
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            output.error = f"stream chunk is not JSON: {data[:200]}"
            return
        if not isinstance(payload, dict):
            output.error = f"stream chunk is not a JSON object: {data[:200]}"
            return
        if "error" in payload:
            output.error = f"error event in stream: {json.dumps(payload['error'])[:500]}"
            return
        if usage := payload.get("usage"):
            output.output_tokens = usage.get("completion_tokens")
        text = "".join(_chunk_text(c) for c in payload.get("choices") or [])
        if text:
            if not output.generated_text:
                output.ttft = now - output.start_time
            else:
                output.itl.append(now - last)
            last = now
            output.generated_text += text
    output.latency = clock() - output.start_time
    output.success = True


async def send_request(
    session: aiohttp.ClientSession,
    settings: RequestSettings,
    sample: SampleRequest,
    clock: Clock = time.perf_counter,
    output: RequestOutput | None = None,
) -> RequestOutput:
    """Stream one request into `output` (a new one unless given, so a caller that cancels
    the task can still read what had arrived) and return it."""
    if output is None:
        output = RequestOutput(sample.prompt_len, sample.expected_output_len)
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    output.start_time = clock()
    try:
        async with session.post(
            settings.url, json=request_body(settings, sample), headers=headers
        ) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                output.error = f"HTTP {response.status}: {body}"
                return output
            await read_stream(response.content, output, clock)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        output.error = f"{type(exc).__name__}: {exc}"
    return output
