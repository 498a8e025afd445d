"""The router holds the serving pod's limits (issue 42, item 12): a body over the pod's
4 MiB cap is a 413 in OpenAI's JSON before it is read, a slow body a 408, a connection
that never finishes its headers is closed, and a body's prompt prefix comes from a
bounded parse of its start: JSON nested to any depth, broken, or a lone surrogate is
routed without a prefix, never a router 500.

The router runs in process with aiohttp's real server on loopback, in front of two
loopback HTTP servers that play pods: they answer /metrics with the load gauges and
record the bodies they are sent, which is what these tests are about (the pod's own
answers are the proxy tests' subject)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web
from pagefleet_router.bounded_json import parse_prefix
from pagefleet_router.proxy import Router

from tests.router.router_harness import LoopbackPod
from tests.router.router_harness import running_router as harness_router

MIB = 1 << 20


class RecordingPod(LoopbackPod):
    """Its load gauges, and every body sent."""

    client_max_size = 64 * MIB

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/completions", self.complete)
        router.add_post("/v1/chat/completions", self.complete)

    async def complete(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.read())
        return web.json_response({"object": "text_completion", "choices": []})


@contextlib.asynccontextmanager
async def running_router(pod_count: int = 1, **settings):
    """(router, its base URL, the pods), once the router has scraped every pod."""
    pods = [RecordingPod() for _ in range(pod_count)]
    async with harness_router(pods, **settings) as (url, router):
        yield router, url, pods


async def post(url: str, body: bytes, path: str = "/v1/completions") -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, data=body, headers=headers) as response:
            return response.status, await response.json(), dict(response.headers)


def completion(prompt: str) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()


def decisions(router: Router) -> dict[str, float]:
    counts = {}
    for metric in router.metrics.decisions.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counts[sample.labels["reason"]] = sample.value
    return counts


@pytest.mark.asyncio
async def test_a_body_over_the_pods_cap_is_a_413_in_openai_shape():
    async with running_router() as (_router, url, [pod]):
        status, body, headers = await post(url, completion("x" * (4 * MIB)))
        assert status == 413
        assert body["error"]["code"] == "request_too_large"
        assert body["error"]["type"] == "invalid_request_error"
        assert f"({4 * MIB} bytes; router --max-request-body-bytes)" in body["error"]["message"]
        assert headers["Connection"] == "close"

        async def chunks():  # no Content-Length: the cap holds while the body is read
            for _ in range(5):
                yield b" " * MIB

        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/completions", data=chunks()) as response:
                assert response.status == 413
                assert (await response.json())["error"]["code"] == "request_too_large"

        status, _, _ = await post(url, completion("x" * (4 * MIB - 100)))  # under the cap
        assert status == 200
        assert len(pod.bodies) == 1


@pytest.mark.asyncio
async def test_a_body_slower_than_the_body_timeout_is_a_408():
    async with running_router(body_read_timeout_s=0.5) as (_router, url, [pod]):
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"model": "m",'
        )
        await writer.drain()
        # (aiohttp then reads and drops what the client still sends, for a while, so
        # that closing does not reset the connection before the answer is read.)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"Connection: close" in head
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        writer.close()
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout"
        assert "did not arrive within 0.5s" in error["message"]
        assert pod.bodies == []


@pytest.mark.asyncio
async def test_a_connection_that_never_finishes_its_headers_is_closed():
    async with running_router(header_read_timeout_s=0.5) as (_router, url, _pods):
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n")  # and then nothing
        await writer.drain()
        # aiohttp checks the deadline on a timer of coarse resolution: some seconds.
        assert await asyncio.wait_for(reader.read(), 15) == b""  # closed by the router
        writer.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"model": "m", "messages": [{"role": "user", "content": '
        + b'{"a": ' * 50_000
        + b"1"
        + b"}" * 50_000
        + b"}]}",
        b'{"model": "m", "prompt": "' + b"\\ud800" * 200 + b'"}',
        b'{"model": "m", "prompt": "unterminated',
        b"\xff\xfe not utf-8",
    ],
    ids=["nested-array", "nested-object", "lone-surrogate", "broken", "not-utf8"],
)
async def test_bodies_without_a_usable_prefix_reach_the_pod_unchanged(body):
    """No router 500: the pod answers what it makes of them (its own 400)."""
    async with running_router() as (_router, url, [pod]):
        status, _, _ = await post(url, body)
        assert status == 200
        assert pod.bodies == [body]


@pytest.mark.asyncio
async def test_a_prefix_comes_from_the_start_of_a_body_alone():
    """A body is routed by the prompt in its first --prefix-scan-bytes: what follows is
    not parsed (here it is not even JSON), and the second request sharing that prompt
    start goes where the first went."""
    shared = "You are a careful assistant. " * 300  # 8,700 characters: 64 blocks of 128
    async with running_router(pod_count=2) as (router, url, pods):
        for tail in (b"x" * (3 * MIB), b"y" * MIB):
            body = b'{"model": "m", "prompt": "' + shared.encode() + tail + b'"'  # unclosed
            status, _, _ = await post(url, body)
            assert status == 200
        assert sorted(len(p.bodies) for p in pods) == [0, 2]
        assert decisions(router).get("prefix") == 1


def test_the_bounded_parse_reads_complete_documents_as_json_does():
    for text in [
        '{"a": [1, 2.5, -3e2, true, false, null, "x\\u00e9\\n\\"q\\""], "b": {}}',
        "[]",
        " 5 ",
        '"s"',
        '{"k": {"j": [[], {}]}}',
    ]:
        assert parse_prefix(text, cut=False, max_depth=8) == json.loads(text), text


def test_the_bounded_parse_returns_a_cut_document_as_far_as_it_goes():
    document = '{"model": "m", "messages": [{"role": "user", "content": "caf\\u00e9 au lait"}]}'
    assert parse_prefix(document[:62], cut=True, max_depth=8) == {
        "model": "m",
        "messages": [{"role": "user", "content": "caf"}],  # a cut escape is left out
    }
    assert parse_prefix(document[:-3], cut=True, max_depth=8) == json.loads(document)
    assert parse_prefix('{"n": 12', cut=True, max_depth=8) == {}  # 12 may be 123
    assert parse_prefix('{"prompt": [1, 2', cut=True, max_depth=8) == {"prompt": [1]}


@pytest.mark.parametrize(
    "text",
    ['{"a": 1} {', '{"a" 1}', '{"a": [1}', "[1,]", '{"a": tru}', '"tab\tin string"', '{"a": '],
)
def test_the_bounded_parse_refuses_what_is_not_json(text):
    with pytest.raises(ValueError):  # noqa: PT011 - what is wrong differs for each text
        parse_prefix(text, cut=False, max_depth=8)


def test_the_bounded_parse_refuses_nesting_past_its_bound():
    assert parse_prefix("[" * 8 + "]" * 8, cut=False, max_depth=8)
    with pytest.raises(ValueError, match="deeper than 8"):
        parse_prefix("[" * 9, cut=True, max_depth=8)
