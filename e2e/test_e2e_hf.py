"""`make e2e-local`, hf:// part: an InferenceService whose model is `hf://org/tiny` reaches
Ready and streams a chat completion, with no cluster and no internet.

The Hub is tests/engine/hub_server.py on loopback (a test double that speaks the part of
the Hub API huggingface_hub uses), reached through HF_ENDPOINT set in spec.engine.env; the
API server, the operator process and the kubelet simulation are those of
e2e/test_e2e_local.py. The pod downloads the model into its model cache volume (HF_HOME,
set by the operator).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from e2e import walk
from e2e.kubelet_sim import Forwarder, KubeletSimulation
from e2e.test_e2e_local import START_TIMEOUT_S, condition, read, until
from tests.engine.hub_server import LocalHub, Repo, save_tiny_llama
from tests.operator.test_operator_emulator import ApiServerEmulator, operator  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.kmock(cls=ApiServerEmulator), pytest.mark.asyncio]

NAMESPACE = "e2e-hf"
NAME = "tiny"
ISVC_PATH = f"/apis/pagefleet.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices"


async def test_hf_model_reaches_ready_and_streams(kmock, operator, tmp_path):  # noqa: F811
    api_url = str(kmock.url).rstrip("/")

    def isvc() -> dict:
        return read(f"{api_url}{ISVC_PATH}/{NAME}")

    repo_dir = await asyncio.to_thread(save_tiny_llama, tmp_path / "repo")
    with LocalHub({"org/tiny": Repo.from_dir(repo_dir)}) as hub:
        async with (
            aiohttp.ClientSession(base_url=api_url) as api,
            KubeletSimulation(api, NAMESPACE, tmp_path / "pods", prestop_seconds=0) as simulation,
            Forwarder(simulation, NAME) as service,
        ):
            resource = {
                "apiVersion": "pagefleet.dev/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": NAME, "namespace": NAMESPACE},
                "spec": {
                    "model": {"uri": "hf://org/tiny"},
                    "engine": {
                        "dtype": "float32",
                        "maxModelLen": 256,
                        "env": [{"name": "HF_ENDPOINT", "value": hub.url}],
                    },
                },
            }
            await operator.call("POST", ISVC_PATH, resource)
            await until(
                lambda: condition(isvc(), "Ready").get("status") == "True",
                START_TIMEOUT_S,
                "Ready",
                simulation,
            )
            result = await asyncio.to_thread(walk.stream_chat, service.url, NAME, 16, True)
            assert result.error is None and result.chunks > 1, result

            # The pod downloaded into its model cache volume, each file once.
            (pod,) = simulation.pods[NAME]
            log = pod.log_path.read_text()
            assert "downloading hf://org/tiny" in log, log[-3000:]
            assert set(hub.stats.bodies_sent.values()) == {1}
            cache = tmp_path / "pods" / pod.name / "model-cache" / "huggingface" / "hub"
            assert list(cache.glob("models--org--tiny/snapshots/*/config.json"))

            await operator.call("DELETE", f"{ISVC_PATH}/{NAME}")
            await until(lambda: not isvc(), 60, "the InferenceService to be deleted", simulation)
