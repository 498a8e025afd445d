"""The engine factory of the engine tests (conftest's `make_llm`): tests of one module that
ask for one config share one engine, so the model loads once per config and module."""

import pytest

TINY = {"max_model_len": 64, "kv_cache_memory_bytes": 1 << 20}
_seen: list[int] = []


@pytest.mark.parametrize("turn", ["first", "second"])
def test_two_tests_asking_for_one_config_get_one_engine(make_llm, turn):
    llm = make_llm("builtin://tiny-random", **TINY)
    _seen.append(id(llm))
    assert len(set(_seen)) == 1, "the second test loaded the model again"


def test_one_test_asking_twice_gets_two_engines_and_another_config_a_new_one(make_llm):
    first = make_llm("builtin://tiny-random", **TINY)
    assert make_llm("builtin://tiny-random", **TINY) is not first
    assert make_llm("builtin://tiny-random", **TINY | {"max_num_seqs": 2}) is not first


def test_the_cache_keys_an_engine_by_its_whole_config_defaults_included(make_llm, llm_cache):
    llm = make_llm("builtin://tiny-random", **TINY | {"max_num_seqs": 3})
    entry = next(entry for entry in llm_cache if entry[1] is llm)
    assert entry[0].max_num_seqs == 3 and entry[0].dtype == "float32"
