"""The client's address behind a proxy (issue 68, item 4), through uvicorn on loopback with
the pod's middleware in front of an app that answers the client it sees: from a peer in
--forwarded-allow-ips (`*` as the operator sets it behind the router, or a list) the
client is the X-Forwarded-For entry the proxy appended, the last, never one the client
wrote before it; from any other peer the header is ignored."""

import json
import threading

import httpx
import pytest
import uvicorn
from pagefleet_serve.server.forwarded import LastHopForwardedFor

from tests.server.server_harness import wait_until


async def who(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    body = json.dumps({"client": scope["client"][0], "scheme": scope["scheme"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(params=["*", "127.0.0.1, 10.0.0.0/8"])
def server(request):
    config = uvicorn.Config(
        LastHopForwardedFor(who, request.param),
        host="127.0.0.1",
        port=0,
        proxy_headers=False,
        log_config=None,
        lifespan="off",
    )
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    wait_until(lambda: running.started, 30, "uvicorn to start")
    port = running.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", request.param
    running.should_exit = True
    thread.join(timeout=30)


def seen(url: str, headers: list[tuple[str, str]], local_address: str = "127.0.0.1") -> dict:
    transport = httpx.HTTPTransport(local_address=local_address)
    with httpx.Client(transport=transport, timeout=10) as client:
        return client.get(url, headers=headers).json()


def test_the_client_is_the_entry_the_proxy_appended(server):
    server, _ = server
    # The client wrote "6.6.6.6"; the router appended its real address.
    forged = [("X-Forwarded-For", "6.6.6.6, 10.1.2.3")]
    assert seen(server, forged)["client"] == "10.1.2.3"
    # Over several header lines, the last line's last entry.
    lines = [("X-Forwarded-For", "10.1.2.3"), ("X-Forwarded-For", "6.6.6.6, 10.4.5.6")]
    assert seen(server, lines)["client"] == "10.4.5.6"
    assert seen(server, [("X-Forwarded-Proto", "http, https")])["scheme"] == "https"
    assert seen(server, [])["client"] == "127.0.0.1"


def test_only_a_trusted_peer_names_the_client(server):
    server, trusted = server
    answer = seen(server, [("X-Forwarded-For", "10.1.2.3")], local_address="127.0.0.2")
    assert answer["client"] == ("10.1.2.3" if trusted == "*" else "127.0.0.2")
