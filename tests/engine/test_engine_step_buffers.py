"""A step's metadata, built in one persistent buffer and copied to the device once: the
same values as the per-token definition for mixed batches (decodes, prefill chunks after a
prefix, whole prompts, block tables of several widths), across steps that grow and shrink
the buffer; one copy per forward pass in the engine; on CUDA, no synchronisation before
the sampled tokens come back."""

import random

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.engine.step_buffers import StepBuffers

BLOCK_SIZE = 4


def expected(input_ids, starts, query_lens, tables) -> dict:
    """Every field by its definition, one token at a time: token j of sequence i sits at
    position starts[i] + j, in slot table[position // block_size] * block_size + position %
    block_size; tables are padded with block 0 to the widest."""
    width = max(map(len, tables))
    positions, slots, query_start_loc = [], [], [0]
    for start, q_len, table in zip(starts, query_lens, tables, strict=True):
        for position in range(start, start + q_len):
            positions.append(position)
            slots.append(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
        query_start_loc.append(query_start_loc[-1] + q_len)
    return {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": slots,
        "seq_lens": [s + q for s, q in zip(starts, query_lens, strict=True)],
        "query_start_loc": query_start_loc,
        "block_tables": [t + [0] * (width - len(t)) for t in tables],
    }


def random_batch(rng: random.Random, num_seqs: int, max_context: int):
    """Decodes, prefill chunks after a cached prefix and whole prompts, each with its own
    block table (fresh block ids: none shared)."""
    starts, query_lens, tables, next_block = [], [], [], 1
    for _ in range(num_seqs):
        kind = rng.choice(["decode", "chunk", "prompt"])
        context = rng.randint(3, max_context)
        # A chunk has at least two tokens after a prefix of at least one.
        q_len = {"decode": 1, "chunk": rng.randint(2, context - 1), "prompt": context}[kind]
        starts.append(context - q_len)
        query_lens.append(q_len)
        num_blocks = -(-context // BLOCK_SIZE) + rng.randint(0, 2)  # lookahead blocks too
        tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    input_ids = [rng.randrange(50_000) for _ in range(sum(query_lens))]
    return input_ids, starts, query_lens, tables


def check(inputs, batch, logits_rows, sample_rows) -> None:
    want = expected(*batch)
    attn = inputs.attn
    got = {
        "input_ids": inputs.input_ids,
        "positions": inputs.positions,
        "slot_mapping": attn.slot_mapping,
        "seq_lens": attn.seq_lens,
        "query_start_loc": attn.query_start_loc,
        "block_tables": attn.block_tables,
    }
    for name, tensor in got.items():
        assert tensor.dtype == torch.int64, name
        assert tensor.tolist() == want[name], name
    assert attn.query_lens == batch[2]
    assert attn.seq_lens_host == want["seq_lens"]
    assert attn.query_start_loc_host == want["query_start_loc"]
    assert inputs.logits_rows.tolist() == list(logits_rows)
    assert inputs.sample_rows.tolist() == list(sample_rows)


def test_metadata_matches_its_definition_across_growing_and_shrinking_steps():
    rng = random.Random(0)
    buffers = StepBuffers(torch.device("cpu"), BLOCK_SIZE)
    # (sequences, longest context): small, then wide tables (growth), then narrow ones
    # after wide (stale padding must not show), then more growth.
    capacities = []
    for num_seqs, max_context in [(3, 6), (8, 40), (8, 40), (2, 5), (30, 90), (1, 3), (64, 20)]:
        batch = random_batch(rng, num_seqs, max_context)
        num_tokens = len(batch[0])
        logits_rows = sorted(rng.sample(range(num_tokens), min(num_tokens, num_seqs)))
        sample_rows = [i for i in range(len(logits_rows)) for _ in range(rng.randint(1, 2))]
        inputs = buffers.build(*batch, logits_rows, sample_rows)
        check(inputs, batch, logits_rows, sample_rows)
        capacities.append(buffers.capacity)
    assert capacities == sorted(capacities)  # grown only, never reallocated smaller
    assert len(set(capacities)) < len(capacities)  # and not on every step


def test_a_decode_batch_after_a_wide_prefill_reads_zeros_past_each_table():
    buffers = StepBuffers(torch.device("cpu"), BLOCK_SIZE)
    wide = ([5] * 30, [0], [30], [[3, 4, 5, 6, 7, 8, 9, 10]])
    check(buffers.build(*wide, [29]), wide, [29], [])
    decode = ([1, 2, 3], [5, 0, 8], [1, 1, 1], [[3, 4], [9], [11, 12, 13]])
    check(buffers.build(*decode, [0, 1, 2]), decode, [0, 1, 2], [])


def test_every_metadata_tensor_is_a_view_of_one_device_buffer():
    buffers = StepBuffers(torch.device("cpu"), BLOCK_SIZE)
    inputs = buffers.build([1, 2, 3, 4], [0, 7], [3, 1], [[2], [5, 6]], [2, 3], [0, 0, 1])
    attn = inputs.attn
    tensors = [inputs.input_ids, inputs.positions, inputs.logits_rows, inputs.sample_rows]
    tensors += [attn.slot_mapping, attn.seq_lens, attn.query_start_loc, attn.block_tables]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert storages == {buffers._device.untyped_storage().data_ptr()}


def test_the_engine_copies_metadata_once_per_forward_pass(monkeypatch):
    """Real steps (prefill chunks, decodes, n=2 rows) on the tiny model: each forward pass
    gets views of the one buffer, filled by one copy."""
    llm = LLM(
        "builtin://tiny-random",
        dtype="float32",
        kv_cache_memory_bytes=1 << 20,
        max_model_len=512,
        max_num_batched_tokens=64,
    )
    runner = llm.engine.runner
    copies, passes = [], []
    copy = StepBuffers._copy

    def counting_copy(self, total):
        copies.append(total)
        copy(self, total)

    def checking_run(inputs, *rest):
        passes.append(len(copies))
        device_buffer = runner.buffers._device.untyped_storage().data_ptr()
        assert inputs.input_ids.untyped_storage().data_ptr() == device_buffer
        return run(inputs, *rest)

    run = runner.run
    monkeypatch.setattr(StepBuffers, "_copy", counting_copy)
    monkeypatch.setattr(runner, "run", checking_run)
    prompts = [list(range(1, 100)), [7, 8, 9], [5] * 20]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.8, n=2, seed=1))
    assert [len(out.outputs) for out in outputs] == [2, 2, 2]
    # Pass k ran right after copy k: one copy per forward pass, none in between.
    assert passes == list(range(1, len(copies) + 1))
    llm.engine.block_manager.check_no_leaks()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_decode_step_does_not_synchronise_before_its_tokens_come_back():
    """Metadata built and copied, forward pass and logits: nothing waits for the device;
    the sampled ids' copy back is the step's one synchronisation."""
    from pagefleet_serve.engine.device import RunnerConfig
    from pagefleet_serve.engine.model_runner import ModelRunner
    from pagefleet_serve.model.loader.model_loader import load_model

    device = torch.device("cuda")
    loaded = load_model("builtin://smollm2-135m", torch.bfloat16)
    runner = ModelRunner(loaded, RunnerConfig(device, torch.bfloat16, 16, "auto", "auto"))
    runner.allocate_kv_cache(64)
    tables = [[2 * i, 2 * i + 1] for i in range(4)]
    runner.forward(list(range(100, 180)), [0] * 4, [20] * 4, tables)  # the prompts

    def decode(position: int) -> torch.Tensor:
        inputs = runner.buffers.build([1, 2, 3, 4], [position] * 4, [1] * 4, tables, range(4))
        hidden = runner.run(inputs)
        return runner.model.compute_logits(hidden.index_select(0, inputs.logits_rows))

    decode(20).argmax(dim=-1).tolist()  # kernels compiled, buffers sized
    torch.cuda.set_sync_debug_mode("error")
    try:
        token_ids = decode(21).argmax(dim=-1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(token_ids.tolist()) == 4
