"""Hostile connections and cheap refusals against a real server (uvicorn in a thread, the
built-in model; issue 42, items 2 and 6).

Idle connections that send nothing do not count against --limit-concurrency, and the probes
never share that gate: with more idle connections held than the limit, /health and /ready
answer 200 and a normal request completes. --max-connections-per-client closes a client's
connection beyond its cap at once. Refusals cost what they must and no more: a batch of
prompts too long in all, a prompt longer than a realistic characters-per-token cap, or more
chat messages than the context has tokens are refused before any tokenizing or templating,
and a batch stops at its first prompt over the context."""

import socket
import time

import httpx
import pytest
from pagefleet_serve.frontend.input_processor import MAX_CHARS_PER_TOKEN

from tests.server.server_harness import ThreadServer, assert_error, wait_until

LIMIT = 16
MAX_MODEL_LEN = 256
PER_CLIENT = 24


@pytest.fixture(scope="module")
def server():
    running = ThreadServer(
        {
            "limit_concurrency": LIMIT,
            "header_read_timeout": 120,
            "max_connections_per_client": PER_CLIENT,
        },
        max_num_seqs=4,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=32 << 20,
    )
    yield running
    running.stop()


def idle_connections(server, count: int) -> list[socket.socket]:
    sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(count)]
    time.sleep(0.5)  # accepted by the server's loop
    return sockets


def closed_by_server(sock: socket.socket, timeout: float = 10) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_past_the_limit_block_neither_probes_nor_requests(server):
    held = idle_connections(server, LIMIT + 4)  # more than the limit, fewer than the cap
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            assert http.get("/ready").status_code == 200
            response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert response.status_code == 200, response.text
        assert not any(closed_by_server(sock, timeout=0.01) for sock in held)
    finally:
        for sock in held:
            sock.close()


def test_a_connection_past_the_per_client_cap_is_closed_at_once(server):
    held = idle_connections(server, PER_CLIENT)
    try:
        extra = socket.create_connection(("127.0.0.1", server.port))
        assert closed_by_server(extra), "the connection past the cap stayed open"
        extra.close()
    finally:
        for sock in held:
            sock.close()
    # Closed ones give their places back.
    wait_until(
        lambda: httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200,
        30,
        "a connection to be accepted again",
    )


@pytest.fixture
def tokenized(server, monkeypatch) -> list[str]:
    """Every text the endpoints hand the tokenizer, and every chat template rendering."""
    inputs = server.engine.inputs
    seen: list[str] = []
    tokenize, render_chat = inputs.tokenize, inputs.render_chat

    def counting_tokenize(prompt, *args, **kwargs):
        seen.append(prompt)
        return tokenize(prompt, *args, **kwargs)

    def counting_render(messages, *args, **kwargs):
        seen.append("<template>")
        return render_chat(messages, *args, **kwargs)

    monkeypatch.setattr(inputs, "tokenize", counting_tokenize)
    monkeypatch.setattr(inputs, "render_chat", counting_render)
    return seen


def test_a_batch_too_long_in_all_is_refused_before_any_prompt_is_tokenized(server, tokenized):
    # Each prompt under the per-prompt cap; 64 of them far over what one request is read for.
    prompt = "word " * (MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN // 5 - 1)
    body = {"prompt": [prompt] * 64, "max_tokens": 1}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    error = assert_error(response, 400, code="context_length_exceeded", param="prompt")
    assert "in all" in error["message"], error
    assert tokenized == []


def test_a_batch_stops_at_its_first_prompt_over_the_context(server, tokenized):
    over = "hello world " * 170  # ~340 tokens, under the characters cap
    body = {"prompt": [over, over, over], "max_tokens": 1}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert_error(response, 400, code="context_length_exceeded", param="prompt")
    assert len(tokenized) == 1


def test_a_prompt_past_a_realistic_characters_per_token_cap_is_refused_unread(server, tokenized):
    # Fewer characters than the vocabulary's longest piece times the context allows.
    prompt = "x" * (MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN + 1)
    response = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60
    )
    assert_error(response, 400, code="context_length_exceeded", param="prompt")
    assert tokenized == []


def test_more_messages_than_the_context_has_tokens_are_refused_before_the_template(
    server, tokenized
):
    messages = [{"role": "user", "content": "hi"}] * (MAX_MODEL_LEN + 1)
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1},
        timeout=60,
    )
    error = assert_error(response, 400, code="context_length_exceeded", param="messages")
    assert f"{MAX_MODEL_LEN + 1} messages" in error["message"], error
    assert tokenized == []


def test_one_clients_pile_of_expensive_bodies_does_not_queue_another_client_behind_it(
    server, monkeypatch
):
    """Item 6's fairness: the frontend thread serves clients in turn. One client (this
    loopback address) sends 6 requests whose tokenizing costs 0.3 s each; another client
    (127.0.0.2) then sends one: it is served after at most the job running and one more of
    the first client's, not after all 6 (first in, first out would put it last)."""
    import concurrent.futures

    inputs = server.engine.inputs
    tokenize = inputs.tokenize

    def expensive_tokenize(prompt, *args, **kwargs):
        if "attacker" in prompt:
            time.sleep(0.3)
        return tokenize(prompt, *args, **kwargs)

    monkeypatch.setattr(inputs, "tokenize", expensive_tokenize)
    url = f"{server.base_url}/v1/completions"
    finished: list[str] = []

    def send(name: str, local_address: str) -> None:
        transport = httpx.HTTPTransport(local_address=local_address)
        with httpx.Client(transport=transport, timeout=60) as client:
            prompt = ("attacker " if name != "victim" else "") + "Hello"
            response = client.post(url, json={"prompt": prompt, "max_tokens": 1})
        assert response.status_code == 200, response.text
        finished.append(name)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        attackers = [pool.submit(send, f"attacker-{i}", "127.0.0.1") for i in range(6)]
        wait_until(
            lambda: sum(server.state._frontend.queued().values()) >= 4,
            10,
            "the attacker's requests to queue",
        )
        victim = pool.submit(send, "victim", "127.0.0.2")
        for future in [*attackers, victim]:
            future.result()
    assert finished.index("victim") <= 2, finished


@pytest.mark.parametrize(
    ("hog_address", "victim_address", "forwarded_for", "fair"),
    [
        ("127.0.0.1", "127.0.0.2", None, True),
        # The router's X-Forwarded-For, from a peer in --forwarded-allow-ips (127.0.0.1 by
        # default), names the client: two clients behind one proxy address.
        ("127.0.0.1", "127.0.0.1", "10.1.2.3", True),
        # From any other peer it is ignored: one client, first come first served.
        ("127.0.0.2", "127.0.0.2", "10.1.2.3", False),
    ],
)
def test_a_client_holding_every_seat_gives_one_to_another_client(
    server, hog_address, victim_address, forwarded_for, fair
):
    """Item 7's fairness in the engine: one client's n=4 request takes all max_num_seqs=4
    seats for a hundred steps; another client's request is admitted at once (one of the
    first client's samples is preempted and recomputed), not after the n=4 ends. The n=4
    request still completes whole."""
    import concurrent.futures

    url = f"{server.base_url}/v1/completions"
    hog_body = {"prompt": "Once upon a time", "n": 4, "max_tokens": 160, "ignore_eos": True}
    preemptions_before = server.core.scheduler.num_preemptions

    def post(address, body, headers=None):
        transport = httpx.HTTPTransport(local_address=address)
        with httpx.Client(transport=transport, timeout=300) as client:
            return client.post(url, json=body, headers=headers)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hog = pool.submit(post, hog_address, hog_body)
        wait_until(lambda: len(server.core.scheduler.running) == 4, 60, "the n=4 request to fork")
        headers = {"X-Forwarded-For": forwarded_for} if forwarded_for else None
        response = post(victim_address, {"prompt": "Hello", "max_tokens": 2}, headers)
        assert response.status_code == 200, response.text
        served_while_the_hog_ran = not hog.done()
        answer = hog.result()
    assert served_while_the_hog_ran is fair
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert len(choices) == 4
    assert all(choice["finish_reason"] == "length" for choice in choices), choices
    assert answer.json()["usage"]["completion_tokens"] == 4 * 160
    assert (server.core.scheduler.num_preemptions > preemptions_before) is fair
