"""KV cache events (--kv-events-config) from a real engine, read off a real ZMQ socket and
decoded with vLLM's own definitions, restated here from its published format
(vllm/distributed/kv_events.py: an EventBatch array [ts, events, data_parallel_rank],
events maps tagged by `type`), not with the pod's structs: stored blocks carry the
prompt's tokens in order with a consistent parent chain; a prompt sharing a prefix
stores only its new blocks, chained to the shared ones; eviction publishes BlockRemoved;
a reset publishes AllBlocksCleared; the sequence numbers have no gap, and the replay
socket sends a subscriber what it asks for again."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq
from pagefleet_serve import LLM
from pagefleet_serve.config import KVEventsConfig
from pagefleet_serve.engine.block_manager import hash_block
from pagefleet_serve.sampling_params import SamplingParams

from tests.engine.conftest import smollm_kv_bytes
from tests.server.server_harness import free_port

BLOCK = 16  # the engine's default block size


# vLLM's definitions, field for field.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """What llm-d's indexer does: bind, and let the pods connect and publish."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.next_sequence = 0

    def events(self, timeout_ms: int = 5000) -> list:
        """Every event of the batches that arrive until none comes for `timeout_ms`."""
        events = []
        while self.sub.poll(timeout_ms):
            topic, sequence, payload = self.sub.recv_multipart()
            assert topic == b"kv@"
            assert int.from_bytes(sequence, "big") == self.next_sequence  # no gap
            self.next_sequence += 1
            batch = DECODER.decode(payload)
            assert batch.data_parallel_rank == 0 and batch.ts > 0
            events += batch.events
            timeout_ms = 300
        return events

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def subscriber():
    subscriber = Subscriber()
    yield subscriber
    subscriber.close()


@pytest.fixture(scope="module")
def llm(subscriber):
    replay = f"tcp://127.0.0.1:{free_port()}"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": subscriber.endpoint,  # not a wildcard: the pod connects
        "replay_endpoint": replay,
        "topic": "kv@",
    }
    llm = LLM(
        "builtin://smollm2-135m",
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=smollm_kv_bytes(12),
        kv_events_config=config,
    )
    llm.replay_endpoint = replay
    # The pod's PUB socket connects in the background, and the SUB socket sends it the
    # subscription when it next handles its commands (in a call on it): what the pod sent
    # before would be lost (the sequence numbers would show it).
    assert not subscriber.sub.poll(500)
    yield llm
    llm.engine.close()


def generate(llm: LLM, prompt: list[int]) -> None:
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))


def test_the_flag_is_vllms_json_and_off_unless_enabled():
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": false, "publisher": "zmq"}') is None
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}') is None  # null publisher
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "hwm": 1000, "topic": "kv"}'
    )
    assert (config.endpoint, config.replay_endpoint, config.buffer_steps) == (
        "tcp://*:5557",
        "tcp://*:5558",
        100,
    )
    with pytest.raises(ValueError, match=r"unknown keys \['endpiont'\]"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpiont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="endpoint must be a ZMQ endpoint"):
        KVEventsConfig.from_json(
            '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "localhost:1"}'
        )


def test_stored_blocks_chain_evictions_remove_and_a_reset_clears(llm, subscriber):
    first = [1000 + i for i in range(2 * BLOCK + 8)]  # two full blocks and a partial one
    generate(llm, first)
    (stored,) = subscriber.events()
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == first[: 2 * BLOCK]  # the prompt's tokens, in order
    assert (stored.parent_block_hash, stored.block_size, stored.medium) == (None, BLOCK, "GPU")
    assert stored.lora_id is None
    # Each hash chains over its parent and its block's tokens, as the pod's prefix cache.
    a, b = stored.block_hashes
    assert a == hash_block(None, first[:BLOCK])
    assert b == hash_block(a, first[BLOCK : 2 * BLOCK])

    # A prompt sharing the first block stores only its own, chained to the shared one.
    second = first[:BLOCK] + [2000 + i for i in range(BLOCK + 4)]
    generate(llm, second)
    (more,) = subscriber.events()
    assert more.parent_block_hash == a
    assert more.token_ids == second[BLOCK : 2 * BLOCK]
    assert more.block_hashes == [hash_block(a, second[BLOCK : 2 * BLOCK])]
    cached = {a, b, *more.block_hashes}

    # Prompts of new tokens fill the 12 blocks: the least recently used cached ones go.
    removed = []
    for n in range(3):
        generate(llm, [3000 + 100 * n + i for i in range(4 * BLOCK + 2)])
        for event in subscriber.events():
            if isinstance(event, BlockRemoved):
                assert event.medium == "GPU"
                removed += event.block_hashes
    assert cached <= set(removed), "the first prompts' blocks were not evicted"

    # A reset (nothing running) clears the cache; the next step publishes it first.
    assert llm.engine.block_manager.reset_prefix_cache()
    generate(llm, first)
    cleared, stored_again = subscriber.events()
    assert isinstance(cleared, AllBlocksCleared)
    assert stored_again.block_hashes == [a, b]  # computed again from scratch


def test_the_replay_socket_resends_from_a_sequence_number(llm, subscriber):
    prompts = [[5000 + 100 * n + i for i in range(BLOCK + 1)] for n in range(2)]
    for prompt in prompts:
        generate(llm, prompt)
    subscriber.events()
    last = subscriber.next_sequence - 1
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(llm.replay_endpoint)
    try:
        dealer.send_multipart([b"", (last - 1).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, sequence, payload = dealer.recv_multipart()
            if int.from_bytes(sequence, "big", signed=True) == -1:
                assert payload == b""
                break
            replies.append((int.from_bytes(sequence, "big"), DECODER.decode(payload)))
    finally:
        dealer.close(linger=0)
        context.term()
    assert [sequence for sequence, _ in replies] == [last - 1, last]
    assert [batch.events[-1].token_ids for _, batch in replies] == [p[:BLOCK] for p in prompts]
