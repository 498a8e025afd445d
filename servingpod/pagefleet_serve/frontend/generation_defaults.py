"""A model's recommended sampling settings, as vLLM's `--generation-config` reads them:
the model's `generation_config.json` (Qwen3 and Llama 3 ship one: Qwen3 recommends
temperature 0.6, top_p 0.95, top_k 20) supplies a request's temperature, top_p, top_k,
min_p and repetition_penalty when it leaves them out; `--override-generation-config`
(JSON) adds to them or replaces them. Without them, a request that names no temperature
samples at 1.0, which such models were not tuned for.

Where they come from (`source`): "auto" the model's own directory, "vllm" nowhere (the
request's fields or SamplingParams' defaults only), or a directory holding a
`generation_config.json`. Torch-free: the API process reads it beside the tokenizer.
"""

import json
from pathlib import Path

from pagefleet_serve.sampling_params import SamplingParams

GENERATION_CONFIG = "generation_config.json"
SOURCES_HELP = "auto (the model's generation_config.json), vllm (none) or a directory"
# generation_config.json's keys that become defaults (SamplingParams' names are the same).
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_defaults(
    source: str, model: str, override: dict | str | None = None
) -> dict[str, float | int]:
    """The sampling defaults `source` and `override` (a dict or its JSON text) give for the
    model at URI `model` (SamplingParams' field names); ValueError naming the flag for a
    missing file or a value SamplingParams refuses."""
    if isinstance(override, str):
        try:
            override = json.loads(override) if override.strip() else {}
        except ValueError as exc:
            raise ValueError(f"override_generation_config: not valid JSON: {exc}") from None
    if override is not None and not isinstance(override, dict):
        raise ValueError("override_generation_config: must be a JSON object")
    defaults: dict = {}
    if source == "auto":
        # Resolved as the engine resolves the model (the API side loads no model code
        # otherwise: imported here, once, at start-up).
        from pagefleet_serve.model.loader.resolve import resolve_model_uri

        model_dir = resolve_model_uri(model, weights="none").path  # a GGUF file has none
        if model_dir is not None and model_dir.is_dir():
            defaults = _read(model_dir / GENERATION_CONFIG, required=False)
    elif source != "vllm":
        defaults = _read(Path(source) / GENERATION_CONFIG, required=True)
    unknown = set(override or {}) - set(DEFAULT_FIELDS)
    if unknown:
        raise ValueError(
            f"override_generation_config: {', '.join(sorted(unknown))} cannot be a default; "
            f"allowed: {', '.join(DEFAULT_FIELDS)}"
        )
    defaults |= override or {}
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"generation_config: {exc}") from None
    return defaults


def _read(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ValueError(
                f"generation_config: {path} does not exist (give auto, vllm or a directory "
                f"holding a {GENERATION_CONFIG})"
            )
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    return {name: config[name] for name in DEFAULT_FIELDS if config.get(name) is not None}
