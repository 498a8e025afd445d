"""Whether a model takes images, read from its configuration in the API process (which
loads no model code): a Hugging Face vision-language checkpoint's config.json carries a
`vision_config`. The engine core refuses any architecture it has no family for, so a
server that starts with such a model serves its images."""

import json


def takes_images(model: str) -> bool:
    from pagefleet_serve.model.loader.resolve import resolve_model_uri

    path = resolve_model_uri(model, weights="none").path  # resolved by the core already
    config = None if path is None or not path.is_dir() else path / "config.json"
    if config is None or not config.exists():
        return False
    return "vision_config" in json.loads(config.read_text())
