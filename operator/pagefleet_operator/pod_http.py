"""HTTP from the operator to a serving pod (its IP and `http` port): the autoscaler's
scrape of /metrics and the adapters' load and unload.

The pod's image is the user's choice, so its answer is untrusted: no redirects (they
could point the operator's requests anywhere, its API key with them), no proxies from the
environment (pod IPs are reached directly), a size cap and an overall deadline (a pod
that sends forever, or one byte a second, must not hold the operator's memory or one of
its threads)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from .names import HTTP_PORT, HTTP_PORT_NAME

READ_CHUNK_BYTES = 64 * 1024


class PodAnswerTooLarge(ValueError):
    """The answer was larger, or slower, than allowed."""


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(
            req.full_url, code, f"redirect to {newurl} refused", headers, fp
        )


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _RefuseRedirects)


def get_pod_url(pod: Mapping[str, Any]) -> str:
    """The pod's base URL: its IP and the container port named `http`."""
    port = HTTP_PORT
    for container in pod.get("spec", {}).get("containers", []):
        for item in container.get("ports", []):
            if item.get("name") == HTTP_PORT_NAME:
                port = item["containerPort"]
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def call_pod(
    url: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    *,
    timeout: float,
    max_bytes: int,
) -> bytes:
    """The answer's body (a POST when `body` is given). urllib's HTTPError for a status
    of 400 and above (its body readable from the error), OSError for the connection,
    PodAnswerTooLarge past `max_bytes` or `timeout` in all."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, data=body, headers=dict(headers or {}))
    chunks, size = [], 0
    with _OPENER.open(request, timeout=timeout) as response:
        while chunk := response.read1(READ_CHUNK_BYTES):
            size += len(chunk)
            if size > max_bytes:
                raise PodAnswerTooLarge(f"answer exceeds {max_bytes} bytes")
            if time.monotonic() > deadline:
                raise PodAnswerTooLarge(f"answer took longer than {timeout}s")
            chunks.append(chunk)
    return b"".join(chunks)
