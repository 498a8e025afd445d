"""Serving pods shared by the whole session.

Starting a `pagefleet serve` process (a Python process, then its core process importing
torch and loading the model) is the dearest thing the suite does, so every module whose
needs a request can express shares one pod of each kind instead of starting its own:

- `default_pod`: the built-in model, configured from the environment as the operator
  configures a pod (served name `smol`, 1,024-token context, 256 MiB KV cache, 8 sequences,
  float32 so that two greedy runs of one prompt agree token for token).
- `tools_pod`: the same model with auto tool choice and the hermes tool-call parser, 20
  sequences (structured outputs and tool calls for 20 prompts at once).

A module that needs a flag no request can carry (timeouts, concurrency limits, an API key,
one sequence slot, speculative decoding) or that stops or kills its server keeps a server
of its own. Tests on a shared pod leave it idle and read counters as differences.
"""

from __future__ import annotations

import pytest

from tests.server.server_harness import ServerProcess

DEFAULT_POD_MODEL = "smol"
DEFAULT_POD_MAX_MODEL_LEN = 1024
TOOLS_POD_MODEL = "smol"
TOOLS_POD_MAX_MODEL_LEN = 1024


def _pod(env: dict[str, str], *flags: str):
    process = ServerProcess("--host", "127.0.0.1", *flags, env=env)
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture(scope="session")
def default_pod():
    """The session's default `pagefleet serve` pod (see the module docstring)."""
    yield from _pod(
        {
            "PAGEFLEET_MAX_MODEL_LEN": str(DEFAULT_POD_MAX_MODEL_LEN),
            "PAGEFLEET_KV_CACHE_MEMORY": "256MiB",
            "PAGEFLEET_MAX_NUM_SEQS": "8",
            "PAGEFLEET_SERVED_MODEL_NAME": DEFAULT_POD_MODEL,
            "PAGEFLEET_DTYPE": "float32",
        }
    )


@pytest.fixture(scope="session")
def tools_pod():
    """The session's pod with tool calling on (see the module docstring)."""
    yield from _pod(
        {
            "PAGEFLEET_MAX_MODEL_LEN": str(TOOLS_POD_MAX_MODEL_LEN),
            "PAGEFLEET_KV_CACHE_MEMORY": "256MiB",
            "PAGEFLEET_MAX_NUM_SEQS": "20",
            "PAGEFLEET_SERVED_MODEL_NAME": TOOLS_POD_MODEL,
        },
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    )


@pytest.fixture(scope="session")
def tools_client(tools_pod):
    """An `openai` client of the tools pod."""
    import openai

    return openai.OpenAI(base_url=f"{tools_pod.base_url}/v1", api_key="unused", max_retries=0)
