"""`pagefleet router --ext-proc-port` as a Gateway API Inference Extension Endpoint Picker,
driven over gRPC the way Envoy drives it (messages built from Envoy's ext_proc protos)
in front of two real `pagefleet serve` pods: the destination header and the `envoy.lb`
metadata agree and name a pod (the test then sends the request to that pod, as Envoy
would, and passes the pod's response back through the stream); a prompt sharing a long
prefix goes back to the pod that served it (the served endpoint the data plane reports,
not the pick); the subset hint is obeyed, an empty or foreign subset is a 503; a body
that is not JSON is a 400 and the stream takes the next request; gRPC health answers
SERVING. The second half drives the same server in process in front of loopback pods
whose /metrics say what a test needs (every queue full: a 429), and of a service at zero
replicas (the pick held, the service woken)."""

from __future__ import annotations

import json
import queue

import grpc
import httpx
import pytest
from aiohttp import web
from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue, Metadata
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ProcessingModeBodySendMode as BodyMode,
)
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from envoy_data_plane.google.protobuf import ListValue, Struct, Value
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagefleet_router.discovery import ScrapeSettings
from pagefleet_router.ext_proc import ExtProcServer
from pagefleet_router.proxy import Router, RouterSettings
from pagefleet_serve import metric_names as names

from tests.router.router_harness import LoopbackPod, running_router
from tests.router.test_router_proxy import (
    API_KEY,
    POD_FLAGS,
    RouterProcess,
    auth,
    completion,
    prompt_homed_on,
)
from tests.router.test_router_scale_from_zero import LatePod
from tests.server.server_harness import ServerProcess, free_port

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION = "x-gateway-destination-endpoint"
SHARED = (
    "You are the help desk of a mountain railway. Trains leave every half hour from eight "
    "to six; dogs ride free; bicycles need a reservation in summer. Answer in one short "
    "sentence. Question: "
)


@pytest.fixture(scope="module")
def pods():
    started = [ServerProcess(*POD_FLAGS, "--api-key", API_KEY) for _ in range(2)]
    try:
        yield [p.wait_ready() for p in started]
    finally:
        for process in started:
            process.stop()


@pytest.fixture(scope="module")
def epp(pods):
    """(the router process, a gRPC channel to its ext_proc port)."""
    port = free_port()
    router = RouterProcess([p.base_url for p in pods], "--ext-proc-port", str(port))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    yield router, channel
    channel.close()
    router.stop()


class ExtProcStream:
    """One ext_proc stream as Envoy drives it: messages sent in order, answers read back."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._outbox: queue.Queue = queue.Queue()
        call = channel.stream_stream(
            PROCESS,
            request_serializer=ProcessingRequest.SerializeToString,
            response_deserializer=ProcessingResponse.FromString,
        )
        self._answers = call(iter(self._outbox.get, None), timeout=120)

    def send(self, *messages: ProcessingRequest) -> None:
        for message in messages:
            self._outbox.put(message)

    def receive(self, count: int = 1) -> list[ProcessingResponse]:
        return [next(self._answers) for _ in range(count)]

    def close(self) -> None:
        self._outbox.put(None)
        assert list(self._answers) == []


def headers(
    *fields: tuple[str, str],
    end_of_stream: bool = False,
    mode: BodyMode | None = None,
    metadata: dict[str, dict[str, Value]] | None = None,
    response: bool = False,
) -> ProcessingRequest:
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in fields]
    message = HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end_of_stream)
    context = None
    if metadata is not None:
        context = Metadata(
            filter_metadata={ns: Struct(fields=entry) for ns, entry in metadata.items()}
        )
    config = None
    if mode is not None:
        config = ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode)
    if response:
        return ProcessingRequest(response_headers=message, metadata_context=context)
    return ProcessingRequest(
        request_headers=message, metadata_context=context, protocol_config=config
    )


def post(path: str = "/v1/completions") -> tuple[tuple[str, str], ...]:
    return ((":method", "POST"), (":path", path), ("content-type", "application/json"))


def body(data: bytes, end_of_stream: bool = True, response: bool = False) -> ProcessingRequest:
    message = HttpBody(body=data, end_of_stream=end_of_stream)
    if response:
        return ProcessingRequest(response_body=message)
    return ProcessingRequest(request_body=message)


def subset_hint(*endpoints: str) -> dict[str, dict[str, Value]]:
    values = [Value(string_value=e) for e in endpoints]
    subset = Value(list_value=ListValue(values=values))
    return {"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": subset}}


def destination(answer: ProcessingResponse) -> str:
    """The endpoints an answer names, checking its header and metadata say the same."""
    common = (answer.request_headers or answer.request_body).response
    header = {
        h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
    }[DESTINATION]
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert metadata[DESTINATION].string_value == header
    return header


def refusal(answer: ProcessingResponse) -> tuple[int, dict]:
    immediate = answer.immediate_response
    assert immediate is not None, answer
    return int(immediate.status.code), json.loads(immediate.body)


def endpoint(pod: ServerProcess) -> str:
    return f"127.0.0.1:{pod.port}"


def serve_through(stream: ExtProcStream, payload: bytes, target: str, served: str) -> dict:
    """Envoy's part after the pick: the request to `target`, its response passed back
    through the stream with `served` as the endpoint that answered."""
    response = httpx.post(
        f"http://{target}/v1/completions",
        content=payload,
        headers={**auth(), "Content-Type": "application/json"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    served_metadata = {
        "envoy.lb": {"x-gateway-destination-endpoint-served": Value(string_value=served)}
    }
    stream.send(
        headers((":status", "200"), response=True, metadata=served_metadata),
        body(response.content[:10], end_of_stream=False, response=True),
        body(response.content[10:], response=True),
    )
    head, *chunks = stream.receive(3)
    assert head.response_headers is not None
    echoed = b"".join(c.response_body.response.body_mutation.streamed_response.body for c in chunks)
    assert echoed == response.content
    return response.json()


def test_the_destination_names_a_pod_and_a_shared_prefix_returns_to_the_pod_that_served(pods, epp):
    router, channel = epp
    endpoints = [endpoint(p) for p in pods]
    stream = ExtProcStream(channel)
    payload = json.dumps(completion(SHARED + "When is the first train?", 4)).encode()
    stream.send(headers(*post(), mode=BodyMode.FULL_DUPLEX_STREAMED))
    thirds = [payload[:40], payload[40:-5], payload[-5:]]
    stream.send(*(body(c, end_of_stream=i == 2) for i, c in enumerate(thirds)))
    answer, *replayed = stream.receive(4)
    named = destination(answer).split(",")
    assert sorted(named) == sorted(endpoints)  # the pick, then the other pod as a fallback
    bodies = [r.request_body.response.body_mutation.streamed_response for r in replayed]
    assert [b.body for b in bodies] == thirds and [b.end_of_stream for b in bodies] == [
        False,
        False,
        True,
    ]
    # The gateway's retry went to the fallback: that pod now holds the prefix.
    served = named[1]
    result = serve_through(stream, payload, served, served)
    stream.close()

    for question in ("Can my dog come along?", "Do bicycles need a ticket?"):
        stream = ExtProcStream(channel)
        stream.send(headers(*post(), mode=BodyMode.FULL_DUPLEX_STREAMED))
        payload = json.dumps(completion(SHARED + question, 4)).encode()
        named_again = full_duplex_request_answer(stream, payload)
        assert named_again[0] == served, (question, named_again, served)
        stream.close()

    metrics = router.metrics()
    served_url = f"http://{served}"
    usage = result["usage"]
    assert metrics[f'pagefleet:router_requests_total{{code="200",pod="{served_url}"}}'] == 1
    key = 'pagefleet:router_usage_tokens_total{{kind="{}",pod="{}"}}'
    assert metrics[key.format("prompt", served_url)] == usage["prompt_tokens"]
    assert metrics[key.format("completion", served_url)] == usage["completion_tokens"] == 4
    assert metrics['pagefleet:router_routing_decisions_total{reason="prefix"}'] == 2


def full_duplex_request_answer(stream: ExtProcStream, payload: bytes) -> list[str]:
    stream.send(body(payload))
    answer, replayed = stream.receive(2)
    assert replayed.request_body.response.body_mutation.streamed_response.body == payload
    return destination(answer).split(",")


def test_the_subset_hint_is_obeyed_and_an_empty_or_foreign_subset_is_a_503(pods, epp):
    _, channel = epp
    urls = [p.base_url for p in pods]
    endpoints = [endpoint(p) for p in pods]
    # A prompt the policy alone sends to the first pod, hinted to the second.
    prompt = prompt_homed_on(urls[0], urls)
    payload = json.dumps(completion(prompt, 1)).encode()
    stream = ExtProcStream(channel)
    stream.send(headers(*post(), mode=BodyMode.FULL_DUPLEX_STREAMED))
    assert full_duplex_request_answer(stream, payload) == [endpoints[0], endpoints[1]]
    stream.close()
    stream = ExtProcStream(channel)
    stream.send(
        headers(*post(), mode=BodyMode.FULL_DUPLEX_STREAMED, metadata=subset_hint(endpoints[1]))
    )
    assert full_duplex_request_answer(stream, payload) == [endpoints[1]]
    stream.close()
    for hint in (subset_hint(), subset_hint("10.255.0.9:8000")):
        stream = ExtProcStream(channel)
        stream.send(headers(*post(), mode=BodyMode.FULL_DUPLEX_STREAMED, metadata=hint))
        stream.send(body(payload))
        status, error = refusal(stream.receive()[0])
        assert status == 503 and error["error"]["code"] == "no_pod_available", error
        stream.close()


def test_a_body_that_is_not_json_is_a_400_and_the_stream_takes_the_next_request(pods, epp):
    _, channel = epp
    stream = ExtProcStream(channel)
    stream.send(headers(*post(), mode=BodyMode.FULL_DUPLEX_STREAMED), body(b"{not json"))
    status, error = refusal(stream.receive()[0])
    assert status == 400 and error["error"]["type"] == "invalid_request_error", error
    stream.send(headers(*post()))
    payload = json.dumps(completion("Hello there", 1)).encode()
    assert set(full_duplex_request_answer(stream, payload)) == {endpoint(p) for p in pods}
    stream.close()


def test_buffered_mode_answers_the_headers_at_once_and_names_the_pod_on_the_body(pods, epp):
    _, channel = epp
    stream = ExtProcStream(channel)
    stream.send(headers(*post(), mode=BodyMode.BUFFERED))
    (answer,) = stream.receive()
    assert answer.request_headers is not None
    assert answer.request_headers.response is None  # no destination yet: it needs the body
    stream.send(body(json.dumps(completion("Hello there", 1)).encode()))
    (answer,) = stream.receive()
    assert answer.request_body is not None
    assert set(destination(answer).split(",")) == {endpoint(p) for p in pods}
    stream.close()
    # A request without a body (its headers end the stream) is placed on its headers.
    stream = ExtProcStream(channel)
    stream.send(headers((":method", "GET"), (":path", "/v1/models"), end_of_stream=True))
    (answer,) = stream.receive()
    assert set(destination(answer).split(",")) == {endpoint(p) for p in pods}
    stream.close()


def test_grpc_health_answers_serving(epp):
    _, channel = epp
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("liveness", "readiness", SERVICE):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


class BusyPod(LoopbackPod):
    """A pod whose queue is deeper than the router's limit."""

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """It is never sent a request: the Endpoint Picker only names it."""

    async def metrics(self, _request: web.Request) -> web.Response:
        gauges = {
            names.NUM_REQUESTS_WAITING: 50,
            names.NUM_REQUESTS_RUNNING: 8,
            names.KV_CACHE_USAGE_PERC: 0.9,
        }
        text = "".join(f"# TYPE {g} gauge\n{g} {v}\n" for g, v in gauges.items())
        return web.Response(text=text, content_type="text/plain")


@pytest.mark.asyncio
async def test_every_queue_over_the_limit_sheds_with_a_429_and_a_body_over_the_cap_is_a_413():
    async with running_router([BusyPod(), BusyPod()], max_request_body_bytes=2048) as (_, router):
        server = ExtProcServer(router, "127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = channel.stream_stream(
                    PROCESS,
                    request_serializer=ProcessingRequest.SerializeToString,
                    response_deserializer=ProcessingResponse.FromString,
                )
                payload = json.dumps(completion("Hello there", 1)).encode()
                answers = call(
                    [headers(*post(), mode=BodyMode.FULL_DUPLEX_STREAMED), body(payload)],
                    timeout=30,
                )
                status, error = refusal(await answers.read())
                assert status == 429 and error["error"]["code"] == "overloaded", error
                answers = call(
                    [
                        headers(*post(), mode=BodyMode.FULL_DUPLEX_STREAMED),
                        body(b"x" * 2000, end_of_stream=False),
                        body(b"x" * 100),
                    ],
                    timeout=30,
                )
                status, error = refusal(await answers.read())
                assert status == 413 and error["error"]["code"] == "request_too_large", error
        finally:
            await server.stop()
    assert b"pagefleet:router_shed_total 1.0" in router.metrics.render()
    assert [s.in_flight for s in router.registry.states()] == [0, 0]


@pytest.mark.asyncio
async def test_at_zero_replicas_the_pick_is_held_the_service_woken_and_a_timeout_is_a_503():
    """A scale-from-zero router holds the pick as it holds an HTTP request: the waker is
    called, and no pod by the hold timeout is the HTTP proxy's 503."""
    pod = LatePod(start_pod=False)
    settings = RouterSettings(
        scrape=ScrapeSettings(interval_s=0.2, timeout_s=2.0), hold_timeout_s=1.0
    )
    router = Router(settings, pod, waker=pod)
    runner = web.AppRunner(router.create_app())
    await runner.setup()  # the router's start-up: its session and scrape rounds
    server = ExtProcServer(router, "127.0.0.1", 0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = channel.stream_stream(
                PROCESS,
                request_serializer=ProcessingRequest.SerializeToString,
                response_deserializer=ProcessingResponse.FromString,
            )
            payload = json.dumps(completion("Hello there", 1)).encode()
            answers = call(
                [headers(*post(), mode=BodyMode.FULL_DUPLEX_STREAMED), body(payload)], timeout=30
            )
            status, error = refusal(await answers.read())
    finally:
        await server.stop()
        await runner.cleanup()
    assert pod.wakes == 1
    assert status == 503 and error["error"]["code"] == "model_starting_timeout", error
