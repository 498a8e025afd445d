"""Tiny random embedding checkpoints for the embed task's tests, and transformers' own
embeddings of them as the reference.

A checkpoint is built with transformers' own classes (as the architecture tests build
theirs), with the built-in model's tokenizer, and the sentence-transformers files written
next to it by hand: modules.json (Transformer, Pooling, optionally Normalize) and the
Pooling module's config.json. `headless` saves the base model only (no lm_head, names
without the `model.` prefix), as Qwen3-Embedding ships."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pagefleet_serve.frontend.tokenizer import load_tokenizer

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
}
_ST_FLAGS = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}


def build_embedding_model(
    path: Path,
    family: str = "Llama",
    pooling: str = "mean",
    normalize: bool = True,
    headless: bool = False,
    matryoshka_dimensions: list[int] | None = None,
) -> Path:
    """Write a tiny random `family` (Llama, Qwen2, Qwen3) embedding checkpoint at `path`."""
    import transformers

    tokenizer = load_tokenizer("builtin://smollm2-135m")
    config = getattr(transformers, f"{family}Config")(
        **SMALL,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if matryoshka_dimensions is not None:
        config.matryoshka_dimensions = matryoshka_dimensions
    torch.manual_seed(0)
    model_class = transformers.AutoModel if headless else transformers.AutoModelForCausalLM
    model_class.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (path / "2_Normalize").mkdir()
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    flags = {flag: mode == pooling for mode, flag in _ST_FLAGS.items()}
    st_config = {"word_embedding_dimension": SMALL["hidden_size"], **flags}
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps(st_config | {"include_prompt": True})
    )
    return path


def reference_embeddings(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' AutoModel over each prompt alone (float32), then the pooling and the
    normalisation the checkpoint's sentence-transformers files name."""
    import transformers

    model = transformers.AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    modules = json.loads((path / "modules.json").read_text())
    st_config = json.loads((path / "1_Pooling" / "config.json").read_text())
    normalize = any(m["type"].endswith(".Normalize") for m in modules)
    vectors = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
            if st_config["pooling_mode_mean_tokens"]:
                vector = hidden.mean(dim=0)
            elif st_config["pooling_mode_cls_token"]:
                vector = hidden[0]
            else:
                vector = hidden[-1]
            if normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            vectors.append(vector)
    return vectors


def cosine_distance(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return 1.0 - float(torch.nn.functional.cosine_similarity(a, b, dim=0))
