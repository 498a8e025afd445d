"""A model's generation_config.json supplies the sampling settings a request leaves out
(vLLM's --generation-config), overridable: `pagefleet serve` pods on a tiny random Llama
that transformers wrote with a generation_config.json asking for top_k 1 (so sampling is
greedy whatever the seed) and temperature 0.7; the flags' sources and errors on
`read_generation_defaults` itself."""

import json

import httpx
import pytest
from pagefleet_serve.frontend.generation_defaults import read_generation_defaults

from tests.engine.hub_server import save_tiny_llama
from tests.server.server_harness import ServerProcess

SEEDS = range(6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import GenerationConfig

    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    GenerationConfig(eos_token_id=eos, do_sample=True, temperature=0.7, top_k=1).save_pretrained(
        path
    )
    return path


def serve(checkpoint, *flags: str) -> ServerProcess:
    return ServerProcess(
        "--model", str(checkpoint), "--max-model-len", "256", "--kv-cache-memory", "16MiB", *flags
    )


def texts(pod: ServerProcess, **body) -> set[str]:
    """The texts of one prompt sampled with each seed."""
    found = set()
    for seed in SEEDS:
        response = httpx.post(
            f"{pod.base_url}/v1/completions",
            json={"prompt": "Once upon a time", "max_tokens": 8, "seed": seed} | body,
            timeout=60,
        )
        assert response.status_code == 200, response.text
        found.add(response.json()["choices"][0]["text"])
    return found


def test_the_model_s_defaults_apply_to_left_out_fields_only(checkpoint):
    pod = serve(checkpoint).wait_ready()
    try:
        assert "'temperature': 0.7, 'top_k': 1" in pod.log_text()  # logged at start-up
        greedy = texts(pod, temperature=0)
        assert len(greedy) == 1
        assert texts(pod) == greedy  # top_k 1 from the file: every seed draws the top token
        assert texts(pod, temperature=1.0) == greedy  # still top_k 1
        assert len(texts(pod, top_k=-1)) > 1  # the request's own top_k wins
    finally:
        pod.stop()


def test_vllm_ignores_the_file_and_the_override_applies(checkpoint):
    pod = serve(
        checkpoint,
        "--generation-config",
        "vllm",
        "--override-generation-config",
        '{"temperature": 0}',
    ).wait_ready()
    try:
        greedy = texts(pod)  # the override's temperature 0
        assert len(greedy) == 1
        assert len(texts(pod, temperature=1.0)) > 1  # no top_k 1: the file is not read
    finally:
        pod.stop()


def test_a_bad_generation_config_stops_the_pod_with_a_readable_error(checkpoint, tmp_path):
    pod = serve(checkpoint, "--generation-config", str(tmp_path / "none"))
    try:
        assert pod.process.wait(timeout=240) == 2
        assert "generation_config:" in pod.log_text() and "does not exist" in pod.log_text()
    finally:
        pod.stop()


def test_sources_and_overrides(checkpoint, tmp_path):
    model = str(checkpoint)
    assert read_generation_defaults("auto", model) == {"temperature": 0.7, "top_k": 1}
    assert read_generation_defaults("vllm", model) == {}
    (tmp_path / "generation_config.json").write_text('{"top_p": 0.8, "max_new_tokens": 9}')
    assert read_generation_defaults(str(tmp_path), model) == {"top_p": 0.8}
    assert read_generation_defaults("auto", model, '{"top_k": 5, "min_p": 0.1}') == {
        "temperature": 0.7,
        "top_k": 5,
        "min_p": 0.1,
    }
    assert read_generation_defaults("auto", "builtin://smollm2-135m") == {}  # a GGUF file


@pytest.mark.parametrize(
    ("source", "override", "message"),
    [
        ("auto", "{nope", "override_generation_config: not valid JSON"),
        ("auto", "[1]", "override_generation_config: must be a JSON object"),
        ("auto", '{"seed": 1}', "seed cannot be a default"),
        ("auto", '{"top_p": 2}', "generation_config: top_p must be in"),
        ("/nonexistent", None, "/nonexistent/generation_config.json does not exist"),
    ],
)
def test_bad_sources_and_overrides_are_refused_naming_them(checkpoint, source, override, message):
    with pytest.raises(ValueError, match=message):
        read_generation_defaults(source, str(checkpoint), override)
