"""A stopped in-process server lets its engine go (issue 44's memory retention): FastAPI
keeps the endpoint functions of every app it built in a module-level cache, and through
their closures the server's state; each engine (model, KV pool: ~1.1 GB for the built-in
model) stayed with the test process until the link to the core dropped it on close."""

import gc
import weakref

import httpx

from tests.server.server_harness import ThreadServer


def test_a_stopped_thread_server_frees_its_engine():
    server = ThreadServer({}, max_num_seqs=2, max_model_len=128, kv_cache_memory_bytes=8 << 20)
    response = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    assert response.status_code == 200, response.text
    engine = weakref.ref(server.core)
    model = weakref.ref(server.core.runner.model)
    server.stop()
    del server
    gc.collect()
    assert engine() is None and model() is None
