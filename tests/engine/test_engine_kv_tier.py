"""The KV tier below the prefix cache (--kv-offloading-size, --kv-offload-dir), on a tiny
random Llama saved by transformers: a ~1,500-token prompt whose blocks left the device
cache is served from host memory, and from the files after the engine is restarted over
the same directory, or by a second engine sharing it, with the same greedy tokens and its
prefill skipping the hit tokens (the tokens the model computed are counted); truncated,
corrupted and foreign files are misses, counted and recomputed, never served; a directory
that cannot be written is a warning and a counter, never a failed request."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from pagefleet_serve import LLM
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.block_manager import lora_hash_seed
from pagefleet_serve.engine.kv_tier import tier_namespace
from pagefleet_serve.engine.kv_tier_files import FileTier
from pagefleet_serve.kv_event_messages import hash_block
from pagefleet_serve.sampling_params import SamplingParams

from tests.engine.hub_server import save_tiny_llama

BLOCK = 16
PROMPT = [(7 * i + 11) % 5000 + 300 for i in range(1500)]
OTHER = [(13 * i + 5) % 5000 + 300 for i in range(1500)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
HIT_BLOCKS = (len(PROMPT) - 1) // BLOCK  # the last token is always computed
# Full blocks a served prompt leaves named: its tokens and the computed generated ones.
NAMED_BLOCKS = (len(PROMPT) + GREEDY.max_tokens - 1) // BLOCK


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # Weights far from uniform logits: no greedy near-ties between chunkings.
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama"),
        max_position_embeddings=2048,
        initializer_range=0.2,
    )


def make_llm(model_dir: Path, **tier) -> LLM:
    # Room for one 1,500-token prompt and a bit: a second evicts the first's blocks.
    return LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=1600,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=100 * block_bytes(),
        **tier,
    )


def block_bytes() -> int:
    # 2 (K, V) x 2 layers x 16 tokens x 2 kv heads x 8 dims x 4 bytes
    return 2 * 2 * BLOCK * 2 * 8 * 4


def serve(llm: LLM, prompt: list[int]) -> tuple[list[int], int, int]:
    """Greedy tokens, the prompt's cached tokens, and the tokens the model computed."""
    computed = []
    runner = llm.engine.runner
    forward = runner.forward_batch

    def counting(batch):
        computed.append(len(batch.input_ids))
        return forward(batch)

    runner.forward_batch = counting
    try:
        [output] = llm.generate(prompt, GREEDY)
    finally:
        del runner.forward_batch
    return list(output.outputs[0].token_ids), output.num_cached_tokens, sum(computed)


@pytest.fixture(scope="module")
def cold(model_dir) -> list[int]:
    """The prompt's tokens from an engine without a tier."""
    llm = make_llm(model_dir)
    tokens, cached, computed = serve(llm, PROMPT)
    assert cached == 0 and computed == len(PROMPT) + GREEDY.max_tokens - 1
    llm.engine.close()
    return tokens


def test_evicted_blocks_come_back_from_host_memory(model_dir, cold):
    llm = make_llm(model_dir, kv_offloading_size=0.01)
    assert serve(llm, PROMPT)[0] == cold
    serve(llm, OTHER)  # takes the blocks the first prompt left in the device cache
    # Freed tail first, the first prompt's chain loses its tail first: its first few
    # blocks may stay on the device.
    on_device = 0
    while block_hashes()[on_device] in llm.engine.block_manager.cached:
        on_device += 1
    assert on_device < 10
    tokens, cached, computed = serve(llm, PROMPT)
    assert tokens == cold
    assert cached == HIT_BLOCKS * BLOCK
    assert computed == len(PROMPT) - cached + GREEDY.max_tokens - 1
    tier = llm.stats().kv_tier
    assert tier.cpu_hit_tokens == cached - on_device * BLOCK >= 1400
    assert tier.storage_hit_tokens == 0
    assert tier.cpu_bytes_loaded == (HIT_BLOCKS - on_device) * block_bytes()
    llm.engine.close()


def test_an_int8_cache_keeps_its_scales(model_dir):
    """A quantized block is its codes and their scales: both come back."""
    llm = make_llm(model_dir, kv_cache_dtype="int8", kv_offloading_size=0.01)
    cold_tokens = serve(llm, PROMPT)[0]
    llm.engine.block_manager.reset_prefix_cache()
    tokens, cached, _ = serve(llm, PROMPT)
    assert tokens == cold_tokens and cached == HIT_BLOCKS * BLOCK
    assert llm.stats().kv_tier.cpu_hit_tokens == cached
    llm.engine.close()


def test_restart_over_the_same_directory(model_dir, cold, tmp_path):
    first = make_llm(model_dir, kv_offload_dir=str(tmp_path))
    assert serve(first, PROMPT)[0] == cold
    first.engine.close()  # writes what is queued
    assert len(list(tmp_path.glob("??/*.kvblock"))) == NAMED_BLOCKS

    restarted = make_llm(model_dir, kv_offload_dir=str(tmp_path))
    tokens, cached, computed = serve(restarted, PROMPT)
    assert tokens == cold
    assert cached == HIT_BLOCKS * BLOCK >= 1400
    assert computed == len(PROMPT) - cached + GREEDY.max_tokens - 1
    stats = restarted.stats()
    assert stats.prefix_cache_hits == cached
    assert stats.kv_tier.storage_hit_tokens == cached
    assert stats.kv_tier.storage_invalid_blocks == 0
    restarted.engine.close()


def test_a_slow_disk_holds_up_only_its_own_request(model_dir, cold, tmp_path):
    """The files of a request's blocks are read ahead off the step: while the disk holds
    its read, another request runs to its end; then it is served from the files."""
    first = make_llm(model_dir, kv_offload_dir=str(tmp_path))
    serve(first, PROMPT)
    first.engine.close()
    llm = make_llm(model_dir, kv_offload_dir=str(tmp_path))
    files = llm.engine.kv_tier.files
    disk = threading.Event()
    read = files.read

    def slow_read(key, block_hash):
        assert disk.wait(timeout=30)
        return read(key, block_hash)

    files.read = slow_read
    try:
        llm.add_request("tier", PROMPT, GREEDY)
        llm.add_request("other", OTHER[:40], GREEDY)
        tokens: dict[str, list[int]] = {"tier": [], "other": []}
        finished = {}

        def step() -> None:
            for out in llm.step():  # each step's new tokens
                tokens[out.request_id] += out.outputs[0].token_ids
                if out.finished:
                    finished[out.request_id] = out

        while "other" not in finished:
            step()
        assert "tier" not in finished and tokens["tier"] == []
        assert not llm.engine.kv_tier.ready("tier")
        disk.set()
        while "tier" not in finished:
            step()
    finally:
        del files.read
    assert tokens["tier"] == cold
    assert finished["tier"].num_cached_tokens == HIT_BLOCKS * BLOCK
    assert llm.stats().kv_tier.storage_hit_tokens == HIT_BLOCKS * BLOCK
    llm.engine.close()


def test_two_engines_share_one_directory(model_dir, cold, tmp_path):
    first = make_llm(model_dir, kv_offload_dir=str(tmp_path))
    second = make_llm(model_dir, kv_offload_dir=str(tmp_path))
    serve(first, PROMPT)
    first.engine.kv_tier.files.flush()
    tokens, cached, _ = serve(second, PROMPT)
    assert tokens == cold and cached == HIT_BLOCKS * BLOCK
    assert second.stats().kv_tier.storage_hit_tokens == cached
    first.engine.close()
    second.engine.close()


def test_bad_files_are_recomputed_never_served(model_dir, cold, tmp_path, caplog):
    llm = make_llm(model_dir, kv_offload_dir=str(tmp_path))
    serve(llm, PROMPT)
    payload = llm.engine.runner.read_block(0)
    llm.engine.close()
    tier = llm.engine.kv_tier
    hashes = block_hashes()
    # Block 40's file loses its tail, block 60's has one payload byte flipped, block 80's
    # is another configuration's block (another namespace) renamed into its place.
    path = tier.files.path_of(tier.key(hashes[40]))
    path.write_bytes(path.read_bytes()[:-100])
    path = tier.files.path_of(tier.key(hashes[60]))
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF
    path.write_bytes(bytes(data))
    foreign_dir = tmp_path / "foreign"
    foreign = FileTier(str(foreign_dir), 1 << 30, tier_namespace(model="another"))
    key = tier.key(hashes[80])
    foreign.write(key, hashes[80], payload)
    foreign.close()
    foreign.path_of(key).replace(tier.files.path_of(key))

    restarted = make_llm(model_dir, kv_offload_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="pagefleet_serve.engine.kv_tier_files"):
        tokens, cached, _ = serve(restarted, PROMPT)  # stops at block 40: truncated
        assert tokens == cold and cached == 40 * BLOCK
        restarted.engine.block_manager.reset_prefix_cache()
        restarted.engine.kv_tier.files.flush()  # block 40 written again
        tokens, cached, _ = serve(restarted, PROMPT)  # block 60: fails its checksum
        assert tokens == cold and cached == 60 * BLOCK
        restarted.engine.block_manager.reset_prefix_cache()
        restarted.engine.kv_tier.files.flush()
        tokens, cached, _ = serve(restarted, PROMPT)  # block 80: foreign
        assert tokens == cold and cached == 80 * BLOCK
    assert restarted.stats().kv_tier.storage_invalid_blocks == 3
    warnings = " ".join(record.getMessage() for record in caplog.records)
    assert "truncated" in warnings and "checksum" in warnings and "another model" in warnings
    restarted.engine.close()


def test_unwritable_directory_is_a_warning_not_a_failure(model_dir, cold, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="pagefleet_serve.engine.kv_tier_files"):
        llm = make_llm(model_dir, kv_offload_dir=str(blocker / "kv"))
        tokens, cached, _ = serve(llm, PROMPT)
        llm.engine.kv_tier.files.flush()
    assert tokens == cold and cached == 0
    tier = llm.stats().kv_tier
    assert tier.storage_write_errors >= 1 and tier.storage_bytes_written == 0
    assert any("cannot" in record.getMessage() for record in caplog.records)
    llm.engine.close()


def block_hashes() -> list[bytes]:
    """The prompt's chained block hashes, as the engine names them."""
    hashes: list[bytes] = []
    for i in range(len(PROMPT) // BLOCK):
        parent = hashes[-1] if hashes else lora_hash_seed(None)
        hashes.append(hash_block(parent, PROMPT[i * BLOCK : (i + 1) * BLOCK]))
    return hashes


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_offloading_size": 0}, "kv_offloading_size must be a positive number of GiB"),
        ({"kv_offload_dir_max_size": -1}, "kv_offload_dir_max_size must be a positive"),
        (
            {"kv_offloading_size": 1, "enable_prefix_caching": False},
            "enable_prefix_caching off",
        ),
        ({"kv_offload_dir": "/tmp/x", "tensor_parallel_size": 2}, "tensor_parallel_size"),
    ],
)
def test_settings_the_tier_refuses(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)
