"""Cold start as a new pod has it: `pagefleet serve` with an empty torch extension folder
(a container's, or a fresh venv's) compiles nothing, and its first request is served as
fast as the next ones, because every kernel was loaded and run before /ready."""

import time

import pytest
from openai import OpenAI
from pagefleet_kernels import cpu_attention, cpu_layer_ops

from tests.server.server_harness import ServerProcess, read_metrics

# Three prompts of about the same length and no shared prefix beyond the chat template.
PROMPTS = [
    " ".join(f"{word} {i}" for i in range(60))
    for word in ("apples and pears", "rivers and lakes", "trains and boats")
]


def ttft(client: OpenAI, model: str, prompt: str) -> float:
    started = time.monotonic()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        temperature=0,
        stream=True,
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - started
    assert first is not None
    return first


@pytest.mark.skipif(
    not (cpu_attention.available() and cpu_layer_ops.available()),
    reason="the C++ extensions were not built for this CPU (make install builds them)",
)
def test_a_fresh_pod_compiles_nothing_and_its_first_request_is_as_fast_as_the_next(tmp_path):
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    # A zero-byte build lock left by a build killed half-way: the engine used to wait on
    # it for ever. Nothing reads it now.
    (extensions / "lock").touch()
    server = ServerProcess(env={"TORCH_EXTENSIONS_DIR": str(extensions)}).wait_ready()
    try:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        first, *later = [ttft(client, model, prompt) for prompt in PROMPTS]
        log = server.log_text()
        assert "no C++ extension" not in log, log
        for name in ("pagefleet_paged_attention_cpu", "pagefleet_layer_ops_cpu"):
            assert f"C++ extension {name}: the " in log, log
        assert sorted(p.name for p in extensions.iterdir()) == ["lock"], "something compiled"
        assert first < 2 * sorted(later)[0] + 0.05, (first, later)
        metrics = read_metrics(server.base_url)
        phases = {
            key.split('"')[1]: value
            for key, value in metrics.items()
            if key.startswith("pagefleet:startup_seconds{")
        }
        assert {"imports", "download", "kernel_load", "weight_load", "kv_cache", "warm_up"} <= set(
            phases
        ), phases
        assert all(value >= 0 for value in phases.values()), phases
        core = sum(v for k, v in phases.items() if k != "total")
        assert phases["warm_up"] > 0 and phases["total"] >= core, phases
    finally:
        server.stop()
