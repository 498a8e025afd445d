"""A normal request kept in flight while a test sends hostile ones: a greedy completion
streamed in a thread, whose text, finish reason and token count must equal those of the
same request run alone."""

from __future__ import annotations

import threading

import httpx

from tests.server.server_harness import sse_events

NORMAL_BODY = {
    "prompt": "The history of the city began",
    "max_tokens": 48,
    "temperature": 0,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
}


def run_normal(base_url: str, headers: dict | None = None, body: dict = NORMAL_BODY) -> dict:
    """The normal request, streamed to the end: {"text", "finish_reason", "tokens"}."""
    return _collect(base_url, headers or {}, body, None)


class StreamInFlight:
    """`with StreamInFlight(url) as normal:` returns once its first token has arrived;
    `normal.result()` waits for the end and returns what `run_normal` returns."""

    def __init__(self, base_url: str, headers: dict | None = None, body: dict = NORMAL_BODY):
        self._args = (base_url, headers or {}, body)
        self._first_token = threading.Event()
        self._result: dict | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="normal-stream")

    def __enter__(self) -> StreamInFlight:
        self._thread.start()
        if not self._first_token.wait(60):
            raise AssertionError(f"the normal stream sent no token: {self._error!r}")
        return self

    def __exit__(self, *exc) -> None:
        self._thread.join(timeout=120)

    def result(self) -> dict:
        self._thread.join(timeout=120)
        if self._error is not None:
            raise AssertionError("the normal stream failed") from self._error
        assert self._result is not None, "the normal stream did not finish"
        return self._result

    def _run(self) -> None:
        try:
            self._result = _collect(*self._args, self._first_token)
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self._error = exc
            self._first_token.set()


def _collect(base_url: str, headers: dict, body: dict, first_token: threading.Event | None):
    text, finish_reason, tokens = [], None, None
    lines = []
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                lines.append(line)
                if first_token is not None and '"text":"' in line and '"text":""' not in line:
                    first_token.set()
    for event in sse_events(lines):
        assert not (isinstance(event, dict) and "error" in event), event
        if isinstance(event, dict) and event["choices"]:
            text.append(event["choices"][0]["text"])
            finish_reason = event["choices"][0]["finish_reason"] or finish_reason
        if isinstance(event, dict) and event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    assert sse_events(lines)[-1] == "DONE"
    return {"text": "".join(text), "finish_reason": finish_reason, "tokens": tokens}
