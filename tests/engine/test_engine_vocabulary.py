"""One vocabulary: pagefleet_serve.config names the dtypes, KV cache dtypes, quantizations,
attention backends and architectures; the CLI offers exactly those, and the tables below
it that cannot import it (the kernels, a layer under the serving package) or that map
each name to its details (the loader's GGUF table) hold the same names."""

import argparse

from pagefleet_kernels.kv_cache import QUANTIZED_KV_CACHE_DTYPES
from pagefleet_serve import config
from pagefleet_serve.model import registry
from pagefleet_serve.server import serve


def test_the_kernels_kv_cache_dtypes_are_the_configs():
    assert ("auto", *QUANTIZED_KV_CACHE_DTYPES) == config.KV_CACHE_DTYPES


def test_the_registry_is_the_configs_list_of_architectures():
    """config.py's lists are the torch-free copy of the registry the operator reads."""
    assert registry.gguf_architectures() == tuple(sorted(config.GGUF_ARCHITECTURE_NAMES))
    assert registry.model_types() == tuple(sorted(config.HF_MODEL_TYPES))
    # Each GGUF architecture is served by a family that serves Hugging Face checkpoints too.
    served = {registry.hf_architecture({"model_type": t}) for t in config.HF_MODEL_TYPES}
    assert {registry.gguf_architecture(a) for a in config.GGUF_ARCHITECTURE_NAMES} <= served


def test_the_serve_flags_offer_the_configs_names():
    commands = argparse.ArgumentParser().add_subparsers()
    serve.add_parser(commands)
    choices = {
        action.dest: tuple(action.choices)
        for action in commands.choices["serve"]._actions
        if action.choices is not None
    }
    assert choices["dtype"] == config.DTYPES
    assert choices["kv_cache_dtype"] == config.KV_CACHE_DTYPES
    assert choices["quantization"] == config.QUANTIZATIONS
    assert choices["activation_quantization"] == config.ACTIVATION_QUANTIZATIONS
    assert choices["attention_backend"] == config.ATTENTION_BACKENDS
