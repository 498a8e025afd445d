"""A family added from outside the package: a test-only module registers a variant of
Llama (its embeddings doubled) with the registry, and PageFleet serves a checkpoint of it
end to end, its greedy tokens those transformers' Llama gives for the same maths, with no
other file touched (see docs/architecture.md, "How to add a model")."""

import json

import pytest
import torch
from pagefleet_serve import SamplingParams
from pagefleet_serve.model import registry
from pagefleet_serve.model.models.llama import LlamaForCausalLM

from tests.engine.test_engine_architectures import (
    MAX_NEW_TOKENS,
    PROMPTS,
    build,
    load,
    reference_tokens,
)


class DoubledEmbeddingLlamaForCausalLM(LlamaForCausalLM):
    """Llama whose embedding rows are doubled before the first layer."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * 2


@pytest.fixture
def doubled_llama(monkeypatch):
    """The family registered for this test alone (the registry's tables restored after)."""
    for table in ("_FAMILIES", "_MODEL_TYPES"):
        monkeypatch.setattr(registry, table, dict(getattr(registry, table)))
    registry.register(
        "DoubledEmbeddingLlamaForCausalLM",
        __name__,
        "DoubledEmbeddingLlamaForCausalLM",
        model_types=("doubled_llama",),
    )


def test_a_family_registered_by_a_test_module_is_served(doubled_llama, tmp_path):
    reference = build("Llama", {}, tmp_path)
    config_file = tmp_path / "config.json"
    hf = json.loads(config_file.read_text())
    hf |= {"model_type": "doubled_llama", "architectures": ["DoubledEmbeddingLlamaForCausalLM"]}
    config_file.write_text(json.dumps(hf))
    with torch.no_grad():  # transformers' Llama computing the variant: exact, a power of two
        reference.model.embed_tokens.weight.mul_(2)
    llm = load(tmp_path)
    assert type(llm.engine.runner.model) is DoubledEmbeddingLlamaForCausalLM
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        assert out.outputs[0].token_ids == reference_tokens(reference, prompt)
    llm.engine.block_manager.check_no_leaks()
