"""One vocabulary: pagefleet_serve.config names the dtypes, KV cache dtypes, quantizations,
attention backends and architectures; the CLI offers exactly those, and the tables below
it that cannot import it (the kernels, a layer under the serving package) or that map
each name to its details (the loader's GGUF table) hold the same names."""

import argparse

from pagefleet_kernels.kv_cache import QUANTIZED_KV_CACHE_DTYPES
from pagefleet_serve import config
from pagefleet_serve.model.loader import GGUF_ARCHITECTURES
from pagefleet_serve.server import serve


def test_the_kernels_kv_cache_dtypes_are_the_configs():
    assert ("auto", *QUANTIZED_KV_CACHE_DTYPES) == config.KV_CACHE_DTYPES


def test_the_loaders_gguf_table_covers_the_configs_architectures():
    assert sorted(GGUF_ARCHITECTURES) == sorted(config.GGUF_ARCHITECTURE_NAMES)
    # Each GGUF architecture becomes a Hugging Face model_type the loader serves.
    assert {a.model_type for a in GGUF_ARCHITECTURES.values()} <= set(config.HF_MODEL_TYPES)


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
