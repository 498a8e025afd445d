"""SSE streams that common readers read whole: vLLM's benchmark client (`vllm bench serve`),
httpx-sse and the openai client. vLLM's reader strips each line and glues what is left
onto a buffer it cuts at blank lines, so a `: keep-alive` comment swallows every event
after it; the server therefore sends no comments unless asked to
(`--sse-keepalive-interval N`, for proxies with idle timeouts)."""

import asyncio
import json
import threading

import aiohttp
import httpx
import pytest
from httpx_sse import connect_sse
from pagefleet_serve.server.openai_api import KEEPALIVE, sse_event

from tests.server.server_harness import ServerProcess, wait_until

BODY = {"prompt": "The river", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


class VllmLikeReader:
    """Reads a stream as vLLM's benchmark client does: each received line is stripped of
    surrounding whitespace (blank ones dropped) and appended to a buffer; an event is what
    precedes a blank line in the buffer, or the whole buffer once it is a `data: ` line
    holding JSON or [DONE]."""

    def __init__(self) -> None:
        self.buffer = ""

    def add(self, line: str) -> list[str]:
        line = line.strip()
        if not line:
            return []
        self.buffer += line
        events = []
        while "\n\n" in self.buffer:
            event, self.buffer = self.buffer.split("\n\n", 1)
            events.append(event.strip())
        if self.buffer.startswith("data: "):
            content = self.buffer.removeprefix("data: ")
            if content == "[DONE]" or _is_json(content):
                events.append(self.buffer)
                self.buffer = ""
        return [e.removeprefix("data: ") for e in events if e and not e.startswith(":")]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_the_vllm_reader_loses_the_events_after_a_keepalive_comment():
    """Why keep-alive is off by default: fed the server's own bytes, this reader keeps
    the event before a comment and loses every one after it."""
    event = sse_event({"choices": [{"text": "a"}]})
    reader = VllmLikeReader()
    lines = (event + KEEPALIVE + event + "data: [DONE]\n\n").splitlines(keepends=True)
    seen = [e for line in lines for e in reader.add(line)]
    assert seen == [event.strip().removeprefix("data: ")]


@pytest.fixture(scope="module")
def server():
    """The default server (no keep-alive), one sequence at a time so that a request can
    wait behind another."""
    running = ServerProcess("--max-num-seqs", "1", "--max-model-len", "256").wait_ready()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def expected(server) -> str:
    response = httpx.post(f"{server.base_url}/v1/completions", json=BODY, timeout=120)
    return response.json()["choices"][0]["text"]


class Blocker:
    """A long request that holds the server's only sequence slot while a test reads."""

    def __init__(self, base_url: str) -> None:
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(base_url,))

    def _run(self, base_url: str) -> None:
        body = BODY | {"max_tokens": 24, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.started.set()

    def __enter__(self) -> "Blocker":
        self.thread.start()
        wait_until(self.started.is_set, 120, "the blocking request's first token")
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join(timeout=120)


async def read_like_vllm(base_url: str) -> tuple[str, list[str]]:
    reader, text, raw = VllmLikeReader(), [], []
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base_url}/v1/completions", json=BODY | {"stream": True}) as r:
            async for line in r.content:
                raw.append(line.decode())
                for event in reader.add(line.decode()):
                    if event != "[DONE]":
                        text.append(json.loads(event)["choices"][0]["text"])
    return "".join(text), raw


def test_the_vllm_reader_reads_a_queued_stream_whole(server, expected):
    with Blocker(server.base_url):
        text, raw = asyncio.run(read_like_vllm(server.base_url))
    assert text == expected
    assert not [line for line in raw if line.startswith(":")]
    assert raw[-2:] == ["data: [DONE]\n", "\n"]


def test_httpx_sse_reads_a_queued_stream_whole(server, expected):
    with Blocker(server.base_url), httpx.Client(timeout=120) as client:
        url = f"{server.base_url}/v1/completions"
        with connect_sse(client, "POST", url, json=BODY | {"stream": True}) as source:
            data = [event.data for event in source.iter_sse()]
    assert data[-1] == "[DONE]"
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == expected
