"""/v1/responses behind the router: a pod keeps its responses in its own store, so a
request that names one (`previous_response_id`, GET or DELETE /v1/responses/{id}) must
reach the pod that answered it, whatever its prompt's prefix says. The router learns each
response's pod from the first bytes it relays (the JSON's or the stream's first `id`),
even when that id arrives split across chunks or `previous_response_id` sits behind an
input longer than the prefix scan. The router runs in process on loopback in front of two
loopback HTTP servers in pods' places, each with its own store; each turn's input is
chosen so that the prefix policy alone would send it to the other pod (whose 404 would
break the conversation)."""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import pytest
from aiohttp import web
from pagefleet_router.policy import PodState, PolicyConfig, choose_pod, rendezvous_order
from pagefleet_router.prefix import block_hashes, prompt_text

from tests.router.router_harness import LoopbackPod, running_router

BLOCK_CHARS = 128  # RouterSettings' default


class Pod(LoopbackPod):
    """/v1/responses with a store of its own (an unknown previous_response_id or id is
    OpenAI's 404), streamed with the first event cut inside the response's id. Records
    the requests it is sent."""

    client_max_size = 4 << 20

    def __init__(self) -> None:
        super().__init__()
        self.store: dict[str, dict] = {}
        self.seen: list[tuple[str, str | None]] = []  # (method, response id named)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/responses", self.create)
        router.add_get("/v1/responses/{response_id}", self.retrieve)
        router.add_delete("/v1/responses/{response_id}", self.delete)

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        previous = body.get("previous_response_id")
        self.seen.append(("POST", previous))
        if previous is not None and previous not in self.store:
            return _not_found(previous, "previous_response_id")
        response = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "pod": self.url}
        self.store[response["id"]] = response
        if not body.get("stream"):
            return web.json_response(response)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        created = {"type": "response.created", "sequence_number": 0, "response": response}
        event = f"event: response.created\ndata: {json.dumps(created)}\n\n".encode()
        cut = event.index(response["id"].encode()) + 8
        await stream.write(event[:cut])
        await asyncio.sleep(0.05)  # the id's two halves arrive as two chunks
        await stream.write(event[cut:])
        done = {"type": "response.completed", "sequence_number": 1, "response": response}
        await stream.write(f"event: response.completed\ndata: {json.dumps(done)}\n\n".encode())
        await stream.write_eof()
        return stream

    async def retrieve(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        self.seen.append(("GET", response_id))
        if response_id not in self.store:
            return _not_found(response_id, None)
        return web.json_response(self.store[response_id])

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        self.seen.append(("DELETE", response_id))
        if self.store.pop(response_id, None) is None:
            return _not_found(response_id, None)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str, param: str | None) -> web.Response:
    error = {
        "message": f"Response with id '{response_id}' not found.",
        "type": "invalid_request_error",
        "param": param,
        "code": "previous_response_not_found" if param else "response_not_found",
    }
    return web.json_response({"error": error}, status=404)


def input_homed_on(url: str, urls: list[str], topic: str, padding: int = 0) -> str:
    """An input whose prefix's rendezvous home is `url`: where the prefix policy sends it."""
    for i in range(1000):
        text = f"Turn {i}: tell me more about {topic}. " * 4 + "x" * padding
        hashes = block_hashes(
            prompt_text("/v1/responses", {"model": "m", "input": text}), BLOCK_CHARS, 64
        )
        if rendezvous_order(hashes[0], urls)[0] == url:
            return text
    raise AssertionError("no input homed on the pod")


async def send(session: aiohttp.ClientSession, method: str, url: str, **kwargs) -> dict:
    async with session.request(method, url, **kwargs) as response:
        if response.content_type == "text/event-stream":
            events = [
                json.loads(line[len("data: ") :])
                for line in (await response.text()).splitlines()
                if line.startswith("data: ")
            ]
            return events[-1]["response"] | {"status_code": response.status}
        return await response.json() | {"status_code": response.status}


@pytest.mark.asyncio
async def test_a_conversation_stays_on_the_pod_that_holds_its_previous_response():
    pods = [Pod(), Pod()]
    async with running_router(pods) as (url, router), aiohttp.ClientSession() as session:
        urls = [pod.url for pod in pods]
        base = f"{url}/v1/responses"

        async def turn(topic: str, previous: str | None, padding: int = 0, **extra) -> dict:
            """A turn answered by the first pod, although all but the first are homed on
            the other."""
            on = urls[0] if previous is None else urls[1]
            body = {"model": "m", "input": input_homed_on(on, urls, topic, padding)}
            if previous is not None:
                body["previous_response_id"] = previous
            response = await send(session, "POST", base, json=body | extra)
            assert response["status_code"] == 200 and response["pod"] == urls[0], response
            return response

        first = await turn("tides", None)
        holder, other = pods
        # Each later turn's prefix is homed on the other pod; the response id wins.
        second = await turn("waves", first["id"])
        streamed = await turn("storms", second["id"], stream=True)
        # previous_response_id behind an input longer than the router's prefix scan
        await turn("moons", streamed["id"], router.settings.prefix_scan_bytes)
        assert other.seen == []

        retrieved = await send(session, "GET", f"{base}/{streamed['id']}")
        assert retrieved["status_code"] == 200 and retrieved["id"] == streamed["id"]
        deleted = await send(session, "DELETE", f"{base}/{second['id']}")
        assert deleted == {"id": second["id"], "object": "response", "deleted": True} | {
            "status_code": 200
        }
        assert other.seen == []
        assert holder.seen[-2:] == [("GET", streamed["id"]), ("DELETE", second["id"])]
        # The router forgot the deleted id with it: whichever pod gets it answers 404.
        gone = await send(session, "GET", f"{base}/{second['id']}")
        assert gone["status_code"] == 404 and gone["error"]["code"] == "response_not_found"

        decisions = {
            reason: router.metrics.decisions.labels(reason)._value.get()
            for reason in ("response", "prefix", "hash", "load")
        }
        assert decisions["response"] == 5  # three turns, the GET and the DELETE
        assert decisions["hash"] == 1 and decisions["load"] == 1  # the first turn, the 404


def test_the_response_s_holder_wins_over_load_errors_and_prefix_and_a_gone_one_does_not():
    config = PolicyConfig()
    busy = PodState("http://a", num_requests_waiting=50, metrics_age_s=0.1, failing=True)
    idle = PodState("http://b", metrics_age_s=0.1)
    prefix = [b"h1"]
    decision = choose_pod(prefix, [busy, idle], lambda h: "http://b", config, None, "http://a")
    assert (decision.url, decision.reason) == ("http://a", "response")
    gone = choose_pod(prefix, [idle], lambda h: "http://b", config, None, "http://a")
    assert (gone.url, gone.reason) == ("http://b", "prefix")


def test_a_response_s_prefix_is_its_instructions_and_input_as_the_chat_prompt_reads():
    """The pod templates instructions and input as the chat endpoint's system and user
    messages, so the same text shares a prefix (and a pod) across the two endpoints."""
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
        ],
    }
    responses = {"model": "m", "instructions": "Be brief.", "input": "Hello"}
    as_items = responses | {"input": [{"role": "user", "content": "Hello"}]}
    text = prompt_text("/v1/chat/completions", chat)
    assert prompt_text("/v1/responses", responses) == text
    assert prompt_text("/v1/responses", as_items) == text
    assert prompt_text("/v1/responses", {"model": "m", "input": 3}) == "m\n"


class EchoPod(Pod):
    """A pod that answers a completion with the X-Forwarded-For it was sent."""

    async def create(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"forwarded_for": request.headers.getall("X-Forwarded-For", [])})


@pytest.mark.asyncio
async def test_the_pod_is_told_the_client_after_the_clients_own_proxies():
    """The pods share their batch fairly between clients; behind the router every request
    comes from the router's address, so the router appends the client's to
    X-Forwarded-For (the pod trusts the last entry, the router's, with
    --forwarded-allow-ips)."""
    async with running_router([EchoPod()]) as (url, _router):
        connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        async with aiohttp.ClientSession(url, connector=connector) as session:
            plain = await send(session, "POST", "/v1/responses", json={"input": "hi"})
            proxied = await send(
                session,
                "POST",
                "/v1/responses",
                json={"input": "hi"},
                headers={"X-Forwarded-For": "203.0.113.7"},
            )
    assert plain["forwarded_for"] == ["127.0.0.2"]
    assert proxied["forwarded_for"] == ["203.0.113.7, 127.0.0.2"]
