"""Input bounds against a real server (uvicorn in a thread, API key set): every numeric field
bounded (64-bit integers, finite floats), lists capped, fields this server does not
implement refused by name, JSON only, priority only under the priority policy, /docs off
behind an API key, an empty API key refused at start-up; each refusal a 400 (or 413/415)
naming the field, while a normal request in flight finishes as if it ran alone."""

import subprocess
import sys

import httpx
import pytest
from pagefleet_serve.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pagefleet_serve.server.protocol import MAX_PROMPTS_PER_REQUEST

from tests.server.inflight import StreamInFlight, run_normal
from tests.server.server_harness import ThreadServer, assert_error

API_KEY = "bounds-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_LIMIT = 64 << 10
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server():
    running = ThreadServer(
        {"api_key": API_KEY, "max_request_body_bytes": BODY_LIMIT},
        dtype="float32",
        max_num_seqs=4,
        max_model_len=256,
        kv_cache_memory_bytes=32 << 20,
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def alone(server):
    return run_normal(server.base_url, AUTH)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


def raw_json(http, path: str, text: str) -> httpx.Response:
    """A body the JSON encoder would not write (Infinity, NaN, huge numbers)."""
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


# (path, body: dict or raw JSON text, param the 400 must name, words its message must hold)
REFUSED = [
    ("/v1/completions", {"prompt": "hi", "top_k": 10**30}, "top_k", "64-bit"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed", "64-bit"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**70}, "max_tokens", "64-bit"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids", "[0, "),
    ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', "temperature", "finite"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature", "finite"),
    ("/v1/completions", '{"prompt": "hi", "top_p": 1e999}', "top_p", "finite"),
    (
        "/v1/completions",
        '{"prompt": "hi", "repetition_penalty": Infinity}',
        "repetition_penalty",
        "finite",
    ),
    ("/v1/completions", {"prompt": "hi", "priority": -(10**18)}, "priority", "--scheduling"),
    (
        "/v1/completions",
        {"prompt": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)},
        "stop",
        f"at most {MAX_STOP_STRINGS}",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)},
        "stop_token_ids",
        f"at most {MAX_STOP_TOKEN_IDS}",
    ),
    (
        "/v1/completions",
        {"prompt": ["hi"] * (MAX_PROMPTS_PER_REQUEST + 1)},
        "prompt",
        f"at most {MAX_PROMPTS_PER_REQUEST}",
    ),
    ("/v1/completions", {"prompt": "hi", "n": 10**6}, "n", "max_num_seqs"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of", "does not support"),
    (
        "/v1/completions",
        {"prompt": "hi", "use_beam_search": True},
        "use_beam_search",
        "does not support",
    ),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix", "does not support"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"7": 101}}, "logit_bias", "[-100, 100]"),
    (
        "/v1/chat/completions",
        CHAT | {"echo": True},
        "echo",
        "does not support",
    ),
    ("/v1/chat/completions", CHAT | {"tools": [{"type": "function"}]}, "tools", "field required"),
    ("/v1/chat/completions", CHAT | {"tool_choice": "auto"}, "tool_choice", "needs tools"),
    (
        "/v1/completions",
        {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
        "does not support",
    ),
    (
        "/v1/chat/completions",
        CHAT
        | {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objectx"}},
            }
        },
        "response_format",
        "cannot be compiled",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi"}], "temperature": -Infinity}',
        "temperature",
        "finite",
    ),
]


def send(http, path: str, body) -> httpx.Response:
    return raw_json(http, path, body) if isinstance(body, str) else http.post(path, json=body)


@pytest.mark.parametrize(
    ("path", "body", "param", "words"), REFUSED, ids=[f"{i}-{r[2]}" for i, r in enumerate(REFUSED)]
)
def test_out_of_bounds_field_is_400_naming_it(http, path, body, param, words):
    error = assert_error(send(http, path, body), 400, param=param)
    assert param in error["message"] and words in error["message"], error


def test_refusals_leave_a_request_in_flight_untouched(server, http, alone):
    with StreamInFlight(server.base_url, AUTH) as normal:
        for path, body, param, _ in REFUSED:
            assert_error(send(http, path, body), 400, param=param)
        assert normal.result() == alone
    assert http.get("/health").status_code == 200


def test_neutral_values_of_unimplemented_fields_are_accepted(http):
    neutral = {
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "unknown_field": {"ignored": True},
    }
    assert http.post("/v1/chat/completions", json=CHAT | neutral).status_code == 200
    completion = {"prompt": "hi", "max_tokens": 2, "best_of": 1, "echo": False, "suffix": None}
    assert http.post("/v1/completions", json=completion).status_code == 200


def test_a_temperature_below_epsilon_is_greedy(http):
    body = {"prompt": "The capital of France is", "max_tokens": 8}
    tiny = http.post("/v1/completions", json=body | {"temperature": 1e-40}).json()
    greedy = http.post("/v1/completions", json=body | {"temperature": 0}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_bodies_are_read(http, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = http.post("/v1/completions", content=b'{"prompt": "hi"}', headers=headers)
    assert_error(response, 415, code="unsupported_media_type")


def test_a_body_over_the_limit_is_413(http):
    response = http.post("/v1/completions", json={"prompt": "x" * BODY_LIMIT})
    error = assert_error(response, 413, code="request_too_large")
    assert str(BODY_LIMIT) in error["message"] and "--max-request-body-bytes" in error["message"]


def test_queue_limit_defaults_to_the_kv_pool(server):
    engine = server.core
    expected = max(engine.config.max_num_seqs, engine.block_manager.num_blocks)
    assert server.state.max_num_queued == expected


def test_docs_and_schema_are_off_behind_an_api_key(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.base_url}{path}", headers=AUTH).status_code == 404


def test_an_empty_api_key_is_refused_at_start_up():
    result = subprocess.run(
        [sys.executable, "-m", "pagefleet_serve.cli", "serve", "--api-key", ""],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "api_key must not be empty" in result.stderr + result.stdout
