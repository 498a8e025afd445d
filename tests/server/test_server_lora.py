"""LoRA adapters through a real `pagefleet serve` and the official `openai` SDK: a request
names an adapter as its `model`, /v1/models lists adapters with their `parent`, unknown
models are 404, and adapters are loaded and unloaded at runtime (with
--allow-runtime-lora-updating, here from its PAGEFLEET_ environment variable), errors as
OpenAI's JSON.

The adapters are random PEFT files shaped for the built-in model (SmolLM2-135M), written
here: the engine tests pin their arithmetic against PEFT; these pin the API around them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from pagefleet_router.discovery import parse_pod_metrics

from tests.server.server_harness import ServerProcess, assert_error, read_metrics

# SmolLM2-135M: 30 layers, hidden 576, 9 heads and 3 KV heads of 64, MLP 1536.
LAYERS, HIDDEN, Q, KV, INNER = 30, 576, 9 * 64, 3 * 64, 1536
SHAPES = {  # target -> (inputs, outputs)
    "self_attn.q_proj": (HIDDEN, Q),
    "self_attn.v_proj": (HIDDEN, KV),
    "mlp.down_proj": (INNER, HIDDEN),
}
PROMPT = "The capital of France is"


def write_adapter(path, rank: int, seed: int, weights: bool = True) -> str:
    from safetensors.torch import save_file

    path.mkdir()
    targets = sorted({name.split(".")[-1] for name in SHAPES})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (path / "adapter_config.json").write_text(json.dumps(config))
    if weights:
        generator = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in range(LAYERS):
            for name, (fan_in, fan_out) in SHAPES.items():
                key = f"base_model.model.model.layers.{layer}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator)
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator)
        save_file({k: v * 0.05 for k, v in tensors.items()}, path / "adapter_model.safetensors")
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "adapter": write_adapter(root / "adapter", 8, 0),
        "second": write_adapter(root / "second", 4, 1),
        "too-wide": write_adapter(root / "too-wide", 32, 2),
        "no-weights": write_adapter(root / "no-weights", 4, 3, weights=False),
    }


@pytest.fixture(scope="module")
def server(adapters):
    process = ServerProcess(
        "--host",
        "127.0.0.1",
        "--lora-modules",
        f"adapter={adapters['adapter']}",
        "--max-loras",
        "2",
        "--allowed-lora-root",
        str(Path(adapters["adapter"]).parent),
        env={
            "PAGEFLEET_SERVED_MODEL_NAME": "smol",
            "PAGEFLEET_MAX_MODEL_LEN": "512",
            "PAGEFLEET_KV_CACHE_MEMORY": "64MiB",
            "PAGEFLEET_MAX_NUM_SEQS": "4",
            "PAGEFLEET_ENABLE_LORA": "true",
            "PAGEFLEET_ALLOW_RUNTIME_LORA_UPDATING": "1",
        },
    ).wait_ready()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def complete(client, model: str) -> str:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert response.model == model
    return response.choices[0].text


def test_models_lists_the_adapter_with_its_parent(client, adapters):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"smol", "adapter"}
    assert models["adapter"].parent == "smol" and models["adapter"].root == adapters["adapter"]
    assert models["smol"].parent is None


def test_a_request_selects_the_adapter_by_model(client):
    base, adapted = complete(client, "smol"), complete(client, "adapter")
    assert adapted != base  # the adapter changes the output
    assert complete(client, "adapter") == adapted and complete(client, "smol") == base
    chat = client.chat.completions.create(
        model="adapter", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.model == "adapter" and chat.choices[0].message.content is not None


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        complete(client, "no-such-adapter")
    assert caught.value.body["code"] == "model_not_found"


def test_load_and_unload_at_runtime(server, client, adapters):
    url = server.base_url + "/v1"
    body = {"lora_name": "second", "lora_path": adapters["second"]}
    response = httpx.post(f"{url}/load_lora_adapter", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert "second" in {m.id for m in client.models.list().data}
    assert complete(client, "second") != complete(client, "adapter")
    again = httpx.post(f"{url}/load_lora_adapter", json=body, timeout=60)
    assert "already been loaded" in assert_error(again, 400, code="invalid_lora_adapter")["message"]
    unload = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "second"}, timeout=60)
    assert unload.status_code == 200, unload.text
    gone = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "second"}, timeout=60)
    assert_error(gone, 404, code="lora_adapter_not_found", param="lora_name")
    with pytest.raises(openai.NotFoundError):
        complete(client, "second")


def test_adapters_that_cannot_be_loaded_are_400_naming_why(server, adapters):
    url = server.base_url + "/v1/load_lora_adapter"

    def load(name: str, path: str) -> dict:
        response = httpx.post(url, json={"lora_name": name, "lora_path": path}, timeout=60)
        return assert_error(response, 400)

    assert "max_lora_rank 16" in load("too-wide", adapters["too-wide"])["message"]
    error = load("no-weights", adapters["no-weights"])
    assert error["param"] == "lora_path" and "adapter_model.safetensors" in error["message"]
    assert error["code"] == "invalid_lora_adapter"
    assert load("bad name!", adapters["second"])["param"] == "lora_name"
    assert load("smol", adapters["second"])["param"] == "lora_name"
    missing = httpx.post(url, json={"lora_name": "x"}, timeout=10)
    assert_error(missing, 400)


def test_lora_requests_info_names_the_running_adapter(server, client):
    info = "vllm:lora_requests_info"
    stream = client.completions.create(
        model="adapter",
        prompt=PROMPT,
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        next(iter(stream))  # running now
        series = [k for k in read_metrics(server.base_url) if k.startswith(info)]
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
    finally:
        stream.close()
    assert series == [
        f'{info}{{max_lora="2",running_lora_adapters="adapter",waiting_lora_adapters=""}}'
    ]
    # what the router reads of it: this pod holds "adapter" (routing by adapter)
    assert parse_pod_metrics(text).adapters == {"adapter"}


def test_load_and_unload_under_traffic(server, adapters):
    """Requests for the base and the adapter stream on while another adapter is loaded,
    used and unloaded: none fails."""
    asyncio.run(_load_and_unload_under_traffic(server.base_url + "/v1", adapters))


async def _load_and_unload_under_traffic(url: str, adapters: dict) -> None:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)

    async def one(model: str) -> str:
        response = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=24, temperature=0
        )
        return response.choices[0].text

    async def change(http: httpx.AsyncClient) -> str:
        body = {"lora_name": "third", "lora_path": adapters["second"]}
        loaded = await http.post(f"{url}/load_lora_adapter", json=body)
        assert loaded.status_code == 200, loaded.text
        text = await one("third")
        unloaded = await http.post(f"{url}/unload_lora_adapter", json={"lora_name": "third"})
        assert unloaded.status_code == 200, unloaded.text
        return text

    async with httpx.AsyncClient(timeout=120) as http:
        traffic = [one(model) for model in ["smol", "adapter"] * 3]
        results = await asyncio.gather(change(http), *traffic)
    await client.close()
    assert all(results)
    assert len(set(results[1::2])) == 1 and len(set(results[2::2])) == 1  # greedy: the same
