"""The embed task: a tiny random embedding checkpoint (transformers' own classes, the
sentence-transformers pooling files written next to it) served by the one engine, its
vectors equal to transformers' AutoModel pooled and normalised as the files say, whether
a prompt runs alone, in a batch, or in chunks longer than the step's token budget; and the
KV pool whole again after every request (no blocks kept past an embedding)."""

from __future__ import annotations

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams

from tests.engine.embedding_models import (
    build_embedding_model,
    cosine_distance,
    reference_embeddings,
)

CHUNK = 32  # max_num_batched_tokens: the longest prompt below prefills in 4 chunks
PROMPTS = [
    [(7 * i + 3) % 4000 + 10 for i in range(5)],
    [(11 * i + 5) % 4000 + 10 for i in range(23)],
    [(13 * i + 1) % 4000 + 10 for i in range(3 * CHUNK + 7)],
]
CHECKPOINTS = {
    # Llama saved as a causal LM (with its lm_head), mean pooling, normalised.
    "llama-mean": {"family": "Llama", "pooling": "mean"},
    # Qwen3-Embedding's layout: the base model only, last token, normalised.
    "qwen3-last-headless": {"family": "Qwen3", "pooling": "last", "headless": True},
    # Qwen2, the first token, not normalised.
    "qwen2-cls-raw": {"family": "Qwen2", "pooling": "cls", "normalize": False},
}


def load(path, **overrides) -> LLM:
    settings = dict(
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=2 << 20,
        block_size=16,
        max_num_batched_tokens=CHUNK,
    )
    return LLM(str(path), **(settings | overrides))


def assert_matches(vectors, references, normalized: bool) -> None:
    for vector, reference in zip(vectors, references, strict=True):
        assert len(vector) == reference.numel()
        assert cosine_distance(vector, reference) < 1e-5
        scale = 1e-4 if normalized else 1e-3 * float(reference.norm())
        torch.testing.assert_close(torch.tensor(vector), reference, atol=scale, rtol=1e-3)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_embeddings_equal_transformers_pooling(name, tmp_path):
    spec = CHECKPOINTS[name]
    path = build_embedding_model(tmp_path, **spec)
    references = reference_embeddings(path, PROMPTS)
    llm = load(path)  # task auto: modules.json makes it an embed task
    pooling = llm.engine.pooling
    assert pooling is not None and pooling.method == spec["pooling"]
    assert pooling.normalize == spec.get("normalize", True) and pooling.dimensions == 64
    assert not llm.engine.block_manager.enable_prefix_caching
    free = llm.engine.block_manager.num_free_blocks
    normalized = pooling.normalize

    batched = llm.embed(PROMPTS)  # one call: the prompts share steps
    assert_matches([o.embedding for o in batched], references, normalized)
    assert all(o.finished and o.outputs[0].token_ids == [] for o in batched)
    assert [o.prompt_token_ids for o in batched] == PROMPTS
    for prompt, reference in zip(PROMPTS, references, strict=True):  # each alone
        (alone,) = llm.embed(prompt)
        assert_matches([alone.embedding], [reference], normalized)
    assert llm.engine.block_manager.num_free_blocks == free
    llm.engine.block_manager.check_no_leaks()
    assert not llm.engine.has_unfinished_requests()


def test_chunks_of_a_long_prompt_are_pooled_whole(tmp_path):
    """Mean pooling over a prompt 4 steps long, stepped by hand: after each chunk it is
    still running and holds blocks; the step that completes it frees them all."""
    path = build_embedding_model(tmp_path, pooling="mean")
    (reference,) = reference_embeddings(path, [PROMPTS[2]])
    llm = load(path)
    bm = llm.engine.block_manager
    free = bm.num_free_blocks
    request = llm.make_request("long", PROMPTS[2], SamplingParams(), pooling=True)
    llm.add(request)
    outputs, steps = [], 0
    while llm.has_unfinished_requests():
        outputs += llm.step()
        steps += 1
        if llm.has_unfinished_requests():
            assert bm.num_free_blocks < free and not outputs
    assert steps == -(-len(PROMPTS[2]) // CHUNK)
    (output,) = outputs
    assert output.finished and output.outputs[0].finish_reason == "stop"
    assert_matches([output.embedding], [reference], normalized=True)
    assert bm.num_free_blocks == free


def test_text_is_tokenized_with_special_tokens(tmp_path):
    path = build_embedding_model(tmp_path, pooling="last")
    llm = load(path)
    text = "The quick brown fox jumps over the lazy dog."
    ids = llm.tokenizer(text)["input_ids"]
    (by_text,) = llm.embed(text)
    assert by_text.prompt_token_ids == ids
    (reference,) = reference_embeddings(path, [ids])
    assert_matches([by_text.embedding], [reference], normalized=True)


def test_matryoshka_dimensions_only_where_declared(tmp_path):
    declared = build_embedding_model(tmp_path / "mrl", matryoshka_dimensions=[16, 32, 64])
    (reference,) = reference_embeddings(declared, [PROMPTS[1]])
    llm = load(declared)
    assert llm.engine.pooling.matryoshka_dimensions == (16, 32, 64)
    (cut,) = llm.embed(PROMPTS[1], dimensions=16)
    expected = torch.nn.functional.normalize(reference[:16], dim=0)
    assert len(cut.embedding) == 16
    torch.testing.assert_close(torch.tensor(cut.embedding), expected, atol=1e-4, rtol=1e-3)
    with pytest.raises(ValueError, match="dimensions: must be one of"):
        llm.embed(PROMPTS[1], dimensions=24)
    plain = load(build_embedding_model(tmp_path / "plain"))
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        plain.embed(PROMPTS[1], dimensions=16)


def test_each_task_refuses_the_other(tmp_path):
    path = build_embedding_model(tmp_path, pooling="mean")
    embedder = load(path)
    with pytest.raises(ValueError, match="serves embeddings only"):
        embedder.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    # The same files served with task generate: a causal LM again.
    generator = load(path, task="generate")
    assert generator.engine.pooling is None
    (out,) = generator.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="generates text"):
        generator.embed(PROMPTS[0])
    with pytest.raises(ValueError, match="task must be one of"):
        load(path, task="classify")
    with pytest.raises(ValueError, match="never decodes"):
        load(path, speculative_config={"method": "ngram"})
    too_long = list(range(10, 10 + 257))
    with pytest.raises(ValueError, match="maximum context length is 256"):
        embedder.embed(too_long)
    (fits,) = embedder.embed(too_long[:256])  # the whole context: no room kept for tokens
    assert len(fits.embedding) == 64


def test_an_unserved_pooling_mode_is_refused_naming_its_file(tmp_path):
    import json

    from pagefleet_serve.model.uri import UnsupportedModelError

    path = build_embedding_model(tmp_path, pooling="mean")
    pooling_file = path / "1_Pooling" / "config.json"
    config = json.loads(pooling_file.read_text())
    pooling_file.write_text(json.dumps(config | {"pooling_mode_max_tokens": True}))
    with pytest.raises(UnsupportedModelError, match=r"1_Pooling/config\.json.*pooling_mode_max"):
        load(path)


def test_modules_that_would_change_the_vectors_are_refused_by_name(tmp_path):
    """A Dense projection after pooling, or pooling without the prompt's instruction
    tokens, would give other vectors than the checkpoint's: refused, not ignored."""
    import json

    from pagefleet_serve.model.uri import UnsupportedModelError

    path = build_embedding_model(tmp_path, pooling="mean")
    modules = json.loads((path / "modules.json").read_text())
    dense = {"idx": 9, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    (path / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(
        UnsupportedModelError, match=r"modules \['sentence_transformers.models.Dense'\]"
    ):
        load(path)
    (path / "modules.json").write_text(json.dumps(modules))
    pooling_file = path / "1_Pooling" / "config.json"
    pooling_file.write_text(
        json.dumps(json.loads(pooling_file.read_text()) | {"include_prompt": False})
    )
    with pytest.raises(UnsupportedModelError, match="include_prompt false"):
        load(path)


def test_a_hub_download_takes_the_pooling_files():
    from pagefleet_serve.model.loader.hub import select_files

    repo = ["config.json", "tokenizer.json", "model.safetensors", "modules.json",
            "1_Pooling/config.json", "2_Dense/config.json", "README.md"]  # fmt: skip
    files = select_files(repo, None)
    assert {"modules.json", "1_Pooling/config.json"} <= set(files)
    assert "2_Dense/config.json" not in files  # refused at load, never read
