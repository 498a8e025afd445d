"""Multi-LoRA serving in the engine: PEFT adapters on tiny random checkpoints.

- Greedy tokens with an adapter equal transformers' on PEFT's own `merge_and_unload` of
  that adapter (float32), for Llama and Qwen2 (q/k/v biases), adapters targeting every
  projection or a few.
- One step mixing three adapters and the base gives each request what it gets alone.
- The prefix cache never shares K/V between adapters (nor with the base).
- The slots: LRU, ref-counted, a request waits when every slot is read by other adapters.
- Host memory (--max-cpu-loras): never more adapters than that, none a request uses is
  dropped, and a dropped one is read back from its path with the same tokens.
- Adapters that cannot be served are refused naming the file and what is wrong.
"""

from __future__ import annotations

import json

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.block_manager import BlockManager
from pagefleet_serve.engine.lora_cache import LoRAHostCache
from pagefleet_serve.engine.lora_slots import LoRASlots
from pagefleet_serve.engine.scheduler import Scheduler
from pagefleet_serve.engine.sequence import Sequence
from pagefleet_serve.engine.step_buffers import StepBuffers
from pagefleet_serve.model.lora import LoRAAdapter, LoRABusy, LoRAError, LoRANotFound

from tests.engine.test_engine_architectures import reference_tokens

MAX_NEW_TOKENS = 24
SMALL = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,  # far from uniform logits: no greedy near-ties
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, rsLoRA)
ADAPTERS = {
    "every": (8, 16, ALL_TARGETS, False),
    "attention": (4, 8, ["q_proj", "v_proj"], False),
    "mlp": (16, 8, ["gate_proj", "up_proj", "down_proj", "o_proj"], True),
}
PROMPTS = [
    [(7 * i + 3) % 300 + 10 for i in range(19)],
    [(11 * i + 5) % 300 + 10 for i in range(9)],
]
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def build_base(family: str, path, **extra) -> None:
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**SMALL, **extra})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def build_adapter(base_path, path, name: str, seed: int):
    """A random PEFT adapter saved to `path`; returns PEFT's merged model (the reference)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    rank, alpha, targets, rslora = ADAPTERS[name]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero (a no-op adapter): give both halves values
        for key, param in model.named_parameters():
            if "lora_" in key:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


def load(path, adapters: dict, **overrides) -> LLM:
    settings = dict(
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=4 << 20,
        block_size=4,
        enable_lora=True,
        lora_modules=tuple(f"{name}={where}" for name, where in adapters.items()),
        max_loras=3,
    )
    return LLM(str(path), **(settings | overrides))


@pytest.fixture(scope="module", params=["Llama", "Qwen2"])
def checkpoint(request, tmp_path_factory):
    """(family, base dir, {adapter: dir}, {adapter or None: reference tokens per prompt})."""
    import transformers

    root = tmp_path_factory.mktemp(request.param.lower())
    base_path = root / "base"
    build_base(request.param, base_path)
    adapters, references = {}, {}
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    references[None] = [reference_tokens(base.eval(), p, MAX_NEW_TOKENS) for p in PROMPTS]
    for seed, name in enumerate(ADAPTERS):
        adapters[name] = root / name
        merged = build_adapter(base_path, adapters[name], name, seed)
        references[name] = [reference_tokens(merged, p, MAX_NEW_TOKENS) for p in PROMPTS]
    return request.param, base_path, adapters, references


@pytest.fixture(scope="module")
def llm(checkpoint):
    _, base_path, adapters, _ = checkpoint
    return load(base_path, adapters)


def tokens(llm: LLM, prompts, lora_name) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY, lora_name=lora_name)]


def test_adapter_greedy_equals_peft_merge_and_unload(checkpoint, llm):
    family, _, _, references = checkpoint
    for name in [None, *ADAPTERS]:
        got = tokens(llm, PROMPTS, name)
        assert got == references[name], f"{family} adapter {name}"
        if name is not None:  # the adapter changes the output: a no-op would pass too
            assert got != references[None]
    llm.engine.block_manager.check_no_leaks()


def test_one_step_mixing_three_adapters_and_the_base(checkpoint, llm, monkeypatch):
    _, _, _, references = checkpoint
    names = [None, *ADAPTERS]
    alone = {name: tokens(llm, PROMPTS[:1], name)[0] for name in names}
    executor = llm.engine.executor
    execute, slots_per_step = executor.execute, []

    def recording(step):
        slots_per_step.append({item.seq.lora_slot for item in step.scheduled})
        return execute(step)

    monkeypatch.setattr(executor, "execute", recording)
    prompts = [PROMPTS[0]] * len(names) + [PROMPTS[1]] * len(names)
    mixed = tokens(llm, prompts, names + names)
    assert mixed[: len(names)] == [alone[name] for name in names]
    assert mixed[len(names) :] == [references[name][1] for name in names]
    # The steps' rows read the three slots and the base together.
    assert {0, 1, 2, None} in slots_per_step


def test_samples_of_one_request_share_its_adapter_slot(checkpoint, llm):
    _, _, _, references = checkpoint
    params = SamplingParams(n=3, max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    [result] = llm.generate(PROMPTS[1], params, lora_name="mlp")
    assert [o.token_ids for o in result.outputs] == [references["mlp"][1]] * 3
    # Every sample gave its slot back, and its blocks.
    assert llm.engine.scheduler.lora_slots.ref_counts == [0, 0, 0]
    llm.engine.block_manager.check_no_leaks()


def test_prefix_cache_is_keyed_by_adapter(checkpoint, llm):
    _, _, _, references = checkpoint
    engine = llm.engine
    prompt = PROMPTS[0]
    hits = engine.block_manager.prefix_cache_hits
    assert tokens(llm, [prompt], "every") == [references["every"][0]]
    # The same tokens under another adapter (and the base): no block is shared.
    assert tokens(llm, [prompt], "attention") == [references["attention"][0]]
    assert tokens(llm, [prompt], None) == [references[None][0]]
    # The engine may hold blocks of earlier tests' prompts: only new hits count, and the
    # first run's blocks are hit again by the same adapter.
    before_again = engine.block_manager.prefix_cache_hits
    assert tokens(llm, [prompt], "every") == [references["every"][0]]
    assert engine.block_manager.prefix_cache_hits > before_again >= hits


def test_prefix_blocks_differ_per_adapter_in_the_allocator():
    """Without the adapter in the first block's hash, the second lookup would hit."""

    def seq(lora_id, request_id):
        return Sequence(
            request_id, 0, list(range(12)), 12, SamplingParams(), None, 0.0, lora_id=lora_id
        )

    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = seq(1, "a")
    assert bm.allocate(first, 12) == []
    first.num_computed_tokens = 12
    bm.cache_full_blocks(first)
    bm.free(first)
    assert bm.find_cached_prefix(seq(2, "b")) == []
    assert bm.find_cached_prefix(seq(None, "base")) == []
    assert [b.block_id for b in bm.find_cached_prefix(seq(1, "again"))] == [0, 1]


def test_few_slots_many_adapters(checkpoint):
    """One slot, three adapters and the base at once: each adapter's requests wait for the
    slot, in turn, and every request still gets its own tokens."""
    _, base_path, adapters, references = checkpoint
    llm = load(base_path, adapters, max_loras=1)
    names = [*ADAPTERS, None]
    got = tokens(llm, [PROMPTS[1]] * len(names), names)
    assert got == [references[name][1] for name in names]
    slots = llm.engine.scheduler.lora_slots
    assert slots.num_slots == 1 and llm.engine.runner.lora.layers[0]["qkv_proj"][0].shape[0] == 1


def test_a_fused_module_adapted_whole_is_handed_to_the_operator_dense(llm):
    """A slot whose adapter adapts q/k/v as one (Phi-3's fused `qkv_proj`) holds a dense B
    over the parts: the operator is told no parts for that module while the slot holds it
    (the C++ operator skips what lies off the blocks), and the parts again once the slot
    holds an adapter per part; the delta is the adapter's in both."""
    from pagefleet_kernels.metadata import LoRAMapping
    from pagefleet_serve.model.layers.linear import ReplicatedLinear
    from pagefleet_serve.model.layers.lora import LoRABatch, LoRALinear, LoRAWeights, StepAdapters
    from pagefleet_serve.model.lora import fused_layout

    config = llm.engine.runner.model.config
    layout = fused_layout(config)
    (hidden, outs), rank = layout["qkv_proj"], 4
    weights = LoRAWeights(config, 1, rank, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(rank, hidden, generator=generator), torch.randn(sum(outs), rank)
    x = torch.randn(3, hidden, generator=generator)
    slots = torch.tensor([0, 0, -1])
    mapping = LoRAMapping(slots, [(0, torch.tensor([0, 1]))])
    expected = torch.zeros(3, sum(outs))
    expected[:2] = x[:2] @ a.T @ b.T

    base = ReplicatedLinear(hidden, sum(outs))  # adds nothing: the delta alone comes out
    torch.nn.init.zeros_(base.weight)
    adapters = StepAdapters()
    adapters.batch = LoRABatch(weights, mapping, llm.engine.runner.model.backend.add_lora)
    layer = LoRALinear(base, adapters, 0, "qkv_proj")

    def delta() -> torch.Tensor:
        return layer(x)

    weights.load(0, LoRAAdapter("whole", 1, "", rank, {(0, "qkv_proj", None): (a, b)}))
    assert (
        weights.blocks["qkv_proj"] == ()
        and weights.blocks["gate_up_proj"] == (layout["gate_up_proj"][1])
    )
    torch.testing.assert_close(delta(), expected)
    q = b[: outs[0]]
    weights.load(0, LoRAAdapter("q", 2, "", rank, {(0, "qkv_proj", 0): (a, q)}))
    assert weights.blocks["qkv_proj"] == outs
    expected[:2, outs[0] :] = 0
    torch.testing.assert_close(delta(), expected)


# -- the slots ---------------------------------------------------------------------------
def test_step_buffers_group_the_rows_of_each_slot():
    buffers = StepBuffers(torch.device("cpu"), block_size=4)
    inputs = buffers.build(
        [7] * 7, [0, 0, 5, 9], [1, 3, 2, 1], [[0], [1], [2, 3], [4, 5, 6]], lora_slots=[-1, 2, 0, 2]
    )
    assert inputs.lora.token_slots.tolist() == [-1, 2, 2, 2, 0, 0, 2]
    assert [(s, rows.tolist()) for s, rows in inputs.lora.slot_rows] == [
        (0, [4, 5]),
        (2, [1, 2, 3, 6]),
    ]
    assert inputs.lora.rows.tolist() == [4, 5, 1, 2, 3, 6]
    # Slot 0's two rows padded with row 0 (its products there never read) to slot 2's four.
    assert inputs.lora.padded_rows.tolist() == [4, 5, 0, 0, 1, 2, 3, 6]
    assert inputs.lora.padded_positions.tolist() == [0, 1, 4, 5, 6, 7]
    assert inputs.positions.tolist() == [0, 0, 1, 2, 5, 6, 9]  # the rest as without slots
    assert buffers.build([7], [0], [1], [[0]], lora_slots=[-1]).lora is None


def test_slots_are_lru_and_refuse_when_all_are_read():
    slots = LoRASlots(2)
    assert slots.acquire(10) == 0 and slots.acquire(11) == 1
    assert slots.take_loads() == [(0, 10), (1, 11)]
    assert slots.acquire(10) == 0  # resident: no load
    assert not slots.can_acquire(12) and slots.acquire(12) is None
    assert slots.take_loads() == []
    slots.release(1)
    slots.release(0)
    slots.release(0)
    assert slots.idle_slots() == [1, 0]  # slot 1 was released first
    assert slots.acquire(12) == 1  # the least recently used idle slot is replaced
    assert slots.take_loads() == [(1, 12)] and slots.slot_of == {10: 0, 12: 1}
    slots.forget(10)
    assert slots.idle_slots() == [0] and slots.acquire(13) == 0


def test_scheduler_admits_around_an_adapter_that_finds_no_slot():
    config = EngineConfig(model="builtin://tiny-random", enable_lora=True, max_loras=1)
    scheduler = Scheduler(config, BlockManager(32, 4, True), max_model_len=64)

    def seq(request_id, lora_id):
        return Sequence(request_id, 0, [5] * 6, 6, SamplingParams(), None, 0.0, lora_id=lora_id)

    first, second, base = seq("a", 1), seq("b", 2), seq("base", None)
    for s in (first, second, base):
        scheduler.add(s)
    step = scheduler.schedule()
    assert [item.seq for item in step.scheduled] == [first, base]  # b waits for the slot
    assert step.lora_loads == [(0, 1)] and first.lora_slot == 0 and base.lora_slot is None
    scheduler.finish(first, "abort")
    step = scheduler.schedule()
    assert second in [item.seq for item in step.scheduled]
    assert step.lora_loads == [(0, 2)] and second.lora_slot == 0


# -- host memory (--max-cpu-loras) -------------------------------------------------------
def watch_host_memory(llm: LLM, monkeypatch) -> list[int]:
    """The number of adapters in host memory after every step, each step also checking
    that the adapters of the running and waiting requests are there."""
    engine, counts = llm.engine, []
    step = engine.step

    def watched():
        outputs = step()
        scheduler, cache = engine.scheduler, engine.loras.cache
        used = {s.lora_id for s in scheduler.running + scheduler.waiting} - {None}
        assert all(lora_id in cache for lora_id in used), "an adapter in use was dropped"
        assert all(lora_id in cache for lora_id in scheduler.lora_slots.slot_of)
        counts.append(len(cache))
        return outputs

    monkeypatch.setattr(engine, "step", watched)
    return counts


def test_an_adapter_dropped_from_host_memory_is_read_back(checkpoint, monkeypatch):
    _, base_path, adapters, references = checkpoint
    llm = load(base_path, adapters, max_loras=1, max_cpu_loras=2)
    engine = llm.engine
    every = engine.loras.adapters["every"].lora_id
    assert len(engine.loras.cache) == 2 and every not in engine.loras.cache  # of 3 at start
    counts = watch_host_memory(llm, monkeypatch)
    before = tokens(llm, PROMPTS, "every")
    assert before == references["every"]
    assert tokens(llm, PROMPTS, "attention") == references["attention"]
    assert tokens(llm, PROMPTS, "mlp") == references["mlp"]
    assert every not in engine.loras.cache  # the least recently used went
    assert tokens(llm, PROMPTS, "every") == before
    assert every in engine.loras.cache and engine.loras.adapters["every"].lora_id == every
    assert counts and max(counts) <= 2


def test_more_adapters_in_use_than_host_memory_holds_all_finish(checkpoint, monkeypatch):
    """Three adapters and the base at once, host memory for one: each adapter's requests
    wait until no request uses the one there, and every request gets its own tokens."""
    _, base_path, adapters, references = checkpoint
    llm = load(base_path, adapters, max_loras=1, max_cpu_loras=1)
    assert len(llm.engine.loras.cache) == 1
    counts = watch_host_memory(llm, monkeypatch)
    names = [*ADAPTERS, None, *ADAPTERS]
    got = tokens(llm, [PROMPTS[1]] * len(names), names)
    assert got == [references[name][1] for name in names]
    assert max(counts) == 1
    llm.engine.block_manager.check_no_leaks()


def test_an_adapter_that_cannot_be_read_back_fails_its_request_alone(
    checkpoint, tmp_path, monkeypatch
):
    import shutil

    _, base_path, adapters, references = checkpoint
    copy = tmp_path / "every"
    shutil.copytree(adapters["every"], copy)
    llm = load(base_path, {"every": copy, "mlp": adapters["mlp"]}, max_loras=1, max_cpu_loras=1)
    assert llm.engine.loras.adapters["every"].lora_id not in llm.engine.loras.cache
    shutil.rmtree(copy)
    llm.add_request("gone", PROMPTS[1], GREEDY, lora_name="every")
    llm.add_request("base", PROMPTS[1], GREEDY)
    errors, base_tokens = {}, []
    while llm.has_unfinished_requests():
        for output in llm.step():
            errors[output.request_id] = output.error
            if output.request_id == "base":
                base_tokens += output.outputs[0].token_ids
    assert "'every' could not be read again" in errors["gone"]
    assert f"{copy} does not exist" in errors["gone"]
    assert errors["base"] is None and base_tokens == references[None][1]


def host_adapter(lora_id: int) -> LoRAAdapter:
    return LoRAAdapter(f"a{lora_id}", lora_id, f"/a{lora_id}", 4, {})


def test_host_memory_drops_the_lru_unused_adapter_in_no_slot_first():
    slots = LoRASlots(1)
    cache = LoRAHostCache(2, slots)
    for lora_id in (1, 2):
        assert cache.reserve(lora_id, in_use=set())
        cache.put(host_adapter(lora_id))
    slot = slots.acquire(1)
    slots.release(slot)  # adapter 1 stays in its idle slot
    assert cache.reserve(3, in_use=set())  # 1 is the least recent, but 2 is in no slot
    assert 1 in cache and 2 not in cache and 3 not in cache and cache.is_reserved(3)
    with pytest.raises(KeyError):
        cache.use(3)  # reserved, not read yet
    assert cache.reserve(4, in_use={3})  # 1 goes, and with it its slot
    assert 1 not in cache and slots.slot_of == {} and len(cache) == 2
    assert not cache.reserve(5, in_use={3, 4})  # every one in use: nothing changes
    assert len(cache) == 2 and not cache.is_reserved(5)
    cache.put(host_adapter(3))
    cache.drop(4)
    cache.put(host_adapter(4))  # its place went meanwhile (unloaded): left out
    assert 3 in cache and 4 not in cache and cache.use(3).lora_id == 3


def test_host_memory_without_a_limit_keeps_every_adapter():
    cache = LoRAHostCache(None, LoRASlots(1))
    for lora_id in range(1, 6):
        assert cache.reserve(lora_id, in_use=set())
        cache.put(host_adapter(lora_id))
    assert len(cache) == 5 and all(lora_id in cache for lora_id in range(1, 6))


# -- refusals ----------------------------------------------------------------------------
def test_adapters_that_cannot_be_served_are_refused(checkpoint, llm, tmp_path):
    _, _, adapters, _ = checkpoint
    engine = llm.engine
    with pytest.raises(LoRAError, match="rank 16, more than the server's max_lora_rank 8"):
        load(checkpoint[1], {"m": adapters["mlp"]}, max_lora_rank=8)
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(LoRAError, match=f"{missing / 'adapter_model.safetensors'} does not exist"):
        engine.load_lora("missing", str(missing))
    with pytest.raises(LoRAError, match="nowhere does not exist"):
        engine.load_lora("nowhere", str(tmp_path / "nowhere"))
    with pytest.raises(LoRAError, match=r"is not a directory holding adapter_config\.json"):
        engine.load_lora("a-file", str(missing / "adapter_config.json"))
    with pytest.raises(LoRAError, match="'every' has already been loaded"):
        engine.load_lora("every", str(adapters["every"]))
    with pytest.raises(LoRANotFound, match="'nobody' is not loaded"):
        engine.unload_lora("nobody")
    with pytest.raises(ValueError, match="'nobody' is not loaded"):
        llm.generate(PROMPTS[0], GREEDY, lora_name="nobody")
    assert set(engine.loras.adapters) == set(ADAPTERS)


def test_an_adapter_in_use_is_not_unloaded(checkpoint, llm):
    _, _, adapters, references = checkpoint
    engine = llm.engine
    engine.load_lora("again", str(adapters["attention"]))
    llm.add_request("busy", PROMPTS[1], GREEDY, lora_name="again")
    with pytest.raises(LoRABusy, match="in use by 1 requests"):
        engine.unload_lora("again")
    got = []
    while llm.has_unfinished_requests():
        for output in llm.step():
            got += output.outputs[0].token_ids
    assert got == references["attention"][1]
    engine.unload_lora("again")
    assert "again" not in engine.loras.adapters


def test_config_reads_vllms_lora_module_forms_and_checks_them():
    config = EngineConfig(
        enable_lora=True, lora_modules=("a=/x", '{"name": "b", "path": "hf://org/b"}')
    )
    assert [(m.name, m.path) for m in config.lora_modules] == [("a", "/x"), ("b", "hf://org/b")]
    for bad, message in [
        (dict(lora_modules=("a=/x",)), "need enable_lora"),
        (dict(enable_lora=True, lora_modules=("a=/x", "a=/y")), "must be unique"),
        (dict(enable_lora=True, lora_modules=("no-path",)), "is not name=path"),
        (dict(enable_lora=True, lora_modules=("bad name=/x",)), "adapter name 'bad name'"),
        (dict(enable_lora=True, enforce_eager=False), "set enforce_eager"),
        (dict(enable_lora=True, max_loras=0), "max_loras must be a positive integer"),
        (
            dict(enable_lora=True, max_loras=2, max_cpu_loras=1),
            r"max_cpu_loras \(1\) must be at least max_loras \(2\)",
        ),
        (dict(enable_lora=True, max_cpu_loras=0), "max_cpu_loras must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**bad)
