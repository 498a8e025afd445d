"""How an embed model pools, read from its checkpoint's sentence-transformers files.

A sentence-transformers layout (what Qwen3-Embedding, gte-Qwen2 and e5-mistral ship) has a
`modules.json` listing its modules: the Transformer, a Pooling module whose folder (e.g.
`1_Pooling/config.json`) says which `pooling_mode_*` it uses, and optionally a Normalize
module (L2). That file is also what makes `task auto` an embed task. Without it (a GGUF
file, a plain Hugging Face directory served with `task embed`), the defaults are what the
Llama-family decoders' known embedding checkpoints use: the last token, L2-normalised.
Matryoshka truncation is allowed only when config.json declares it (`is_matryoshka`, or
`matryoshka_dimensions`, as vLLM reads them). Torch-free.
"""

import json
from pathlib import Path

from pagefleet_serve.config import PoolingConfig
from pagefleet_serve.model_uri import UnsupportedModelError

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_TRANSFORMER_MODULE = "sentence_transformers.models.Transformer"
_SERVED_MODULES = (_TRANSFORMER_MODULE, _POOLING_MODULE, _NORMALIZE_MODULE)
# sentence-transformers' pooling_mode_* flags -> ours; the others (max, mean_sqrt_len,
# weightedmean) are not served.
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_UNSERVED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


def _modules(path: Path | None) -> list[dict] | None:
    """modules.json's entries, None when the model has none (or is a file)."""
    if path is None or not path.is_dir() or not (path / "modules.json").is_file():
        return None
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"{path}/modules.json cannot be read: {exc}") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise UnsupportedModelError(f"{path}/modules.json is not a list of modules")
    return modules


def is_embedding_checkpoint(path: Path | None) -> bool:
    """Whether a model's files are a sentence-transformers layout with a Pooling module."""
    modules = _modules(path)
    return modules is not None and any(m.get("type") == _POOLING_MODULE for m in modules)


def resolve_task(task: str, path: Path | None) -> str:
    """`task` (config.TASKS) with auto decided by the model's files."""
    if task != "auto":
        return task
    return "embed" if is_embedding_checkpoint(path) else "generate"


def read_pooling_config(path: Path | None, hidden_size: int) -> PoolingConfig:
    """The pooling of an embed model at `path` (a directory or a file; None: generated)."""
    modules = _modules(path) or []
    others = sorted({str(m.get("type")) for m in modules} - set(_SERVED_MODULES))
    if others:  # e.g. a Dense projection after pooling: its vectors would be wrong
        raise UnsupportedModelError(
            f"{path}/modules.json: modules {others} are not served (served: Transformer, "
            "Pooling, Normalize)"
        )
    pooling = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
    method, normalize = "last", True
    if pooling is not None:
        method = _st_method(path / str(pooling.get("path", "")) / "config.json")
        normalize = any(m.get("type") == _NORMALIZE_MODULE for m in modules)
    declared = _hf_config(path)
    dims = declared.get("matryoshka_dimensions")
    if dims is not None and (
        not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims)
    ):
        raise UnsupportedModelError(
            f"{path}/config.json: matryoshka_dimensions must be a list of positive integers"
        )
    return PoolingConfig(
        method,
        normalize,
        hidden_size,
        matryoshka=bool(declared.get("is_matryoshka")) or bool(dims),
        matryoshka_dimensions=tuple(dims) if dims else None,
    )


def _st_method(config_file: Path) -> str:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"{config_file} cannot be read: {exc}") from None
    if config.get("include_prompt") is False:
        raise UnsupportedModelError(
            f"{config_file}: include_prompt false (pooling without the instruction's tokens) "
            "is not served"
        )
    chosen = [mode for flag, mode in _ST_MODES.items() if config.get(flag)]
    unserved = [flag for flag in _UNSERVED_MODES if config.get(flag)]
    if unserved or len(chosen) != 1:
        given = sorted(f for f, on in config.items() if f.startswith("pooling_mode_") and on)
        raise UnsupportedModelError(
            f"{config_file}: exactly one of {sorted(_ST_MODES)} must be true (served: last "
            f"token, mean, cls); got {given}"
        )
    return chosen[0]


def _hf_config(path: Path | None) -> dict:
    if path is None or not path.is_dir() or not (path / "config.json").is_file():
        return {}
    return json.loads((path / "config.json").read_text())
