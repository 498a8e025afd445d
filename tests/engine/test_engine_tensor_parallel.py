"""Tensor and pipeline parallelism over gloo (two ranks, float32): greedy tokens equal one
rank's for the tiny random checkpoint of every architecture test_engine_architectures
builds (`make test`: one of each way a weight is split, SPLIT_KINDS; OLMoE's
whole-projection q/k norms summed over the ranks among them) and for the
built-in GGUF model kept quantized (Q4_1/Q8_0 split at whole blocks; its 3 key/value heads
split 2 and 1), on prompts whose long prefill runs in chunks beside decodes, with a
prefix-cache hit and n > 1; preemption over int8 and fp8 KV caches. In a pipeline: Gemma
2's tied head, soft-capping and sliding windows, MoE layers beside dense ones split 2 and
1, two stages of two ranks each, and speculative decoding with a draft on rank 0. Each
rank holds its part of the weights: about half of the split ones, all of the replicated;
a stage only its layers (and the embedding or the head)."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.executor.multiproc import MultiprocExecutor

from tests.engine.test_engine_architectures import ARCHITECTURES, PROMPTS, build

MAX_TOKENS = 12
SHARED = [(5 * i + 2) % 300 + 10 for i in range(24)]  # a prefix two prompts share


def run(llm: LLM) -> list[list[list[int]]]:
    """Greedy tokens of PROMPTS, then of two prompts sharing a prefix (the second a
    prefix-cache hit) and of n = 2 seeded samples."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]]
    tokens.append([o.outputs[0].token_ids for o in llm.generate([SHARED + [11]], greedy)])
    hit = llm.generate([SHARED + [12, 13]], greedy)[0]
    assert hit.num_cached_tokens > 0
    tokens.append([hit.outputs[0].token_ids])
    sampled = SamplingParams(max_tokens=MAX_TOKENS, n=2, seed=7, ignore_eos=True)
    tokens.append([s.token_ids for s in llm.generate([PROMPTS[1]], sampled)[0].outputs])
    return tokens


TP2 = {"tensor_parallel_size": 2}
PP2 = {"pipeline_parallel_size": 2}


def both(model: str, parallel: dict = TP2, **settings) -> tuple[list, list]:
    """run() on one rank, then over the ranks of `parallel`."""
    settings = (
        dict(
            dtype="float32",
            max_model_len=128,
            kv_cache_memory_bytes=4 << 20,
            block_size=4,
            max_num_batched_tokens=16,  # the 37-token prompt prefills in chunks beside decodes
        )
        | settings
    )
    one = run(LLM(model, **settings))
    llm = LLM(model, **parallel, **settings)
    try:
        ranks = parallel.get("tensor_parallel_size", 1) * parallel.get("pipeline_parallel_size", 1)
        executor = llm.engine.executor
        assert isinstance(executor, MultiprocExecutor) and executor.size == ranks
        return one, run(llm)
    finally:
        llm.engine.close()


# make test splits these: each way a weight is split over the ranks (fused q/k/v and
# gate/up, a tied head whose logits are capped after the gather, experts beside a shared
# expert, q/k norms over the whole projection summed over the ranks). The rest of the
# sweep (`make test-engine-slow`) adds only what one rank's tests cover (sliding windows,
# per-head q/k norms, rope kinds, other checkpoints' expert names); biases are split in
# the quantized-KV preemption tests below.
SPLIT_KINDS = ("phi3-fused-sliding-window", "gemma2", "qwen2-moe-shared-expert", "olmoe")


@pytest.mark.parametrize(
    "arch",
    [
        pytest.param(arch, marks=() if arch in SPLIT_KINDS else pytest.mark.slow)
        for arch in sorted(ARCHITECTURES)
    ],
)
def test_two_ranks_give_one_ranks_tokens(arch, tmp_path):
    family, extra = ARCHITECTURES[arch]
    build(family, extra, tmp_path)
    one, two = both(str(tmp_path))
    assert two == one


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_two_ranks_preempt_over_a_quantized_kv_cache_as_one_rank(kv_cache_dtype, tmp_path):
    """Six 20-token prompts need 48 blocks; the pool holds 17 at one rank (34 at two, each
    rank's half of the heads costing half): both preempt and recompute, and their
    greedy tokens agree."""
    family, extra = ARCHITECTURES["qwen2-biases"]
    build(family, extra, tmp_path)
    prompts = [[(5 * i + 3 * j) % 300 + 10 for j in range(20)] for i in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens, preemptions = [], []
    for size in (1, 2):
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            max_model_len=64,
            block_size=4,
            kv_cache_dtype=kv_cache_dtype,
            # K and V x 3 layers x 4 tokens x 2 heads x (16 bytes + a float32 scale) a block
            kv_cache_memory_bytes=17 * 2 * 3 * 4 * 2 * (16 + 4),
            tensor_parallel_size=size,
        )
        try:
            assert llm.engine.scheduler.block_manager.num_blocks == 17 * size
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy)])
            preemptions.append(llm.engine.scheduler.num_preemptions)
        finally:
            llm.engine.close()
    assert all(preemptions), preemptions
    assert tokens[1] == tokens[0]


@pytest.mark.parametrize("arch", ["gemma2", "qwen2-mixed-layers"])
def test_two_stages_give_one_ranks_tokens(arch, tmp_path):
    family, extra = ARCHITECTURES[arch]
    build(family, extra, tmp_path)
    one, two = both(str(tmp_path), PP2)
    assert two == one


def test_two_stages_of_two_ranks_give_one_ranks_tokens(tmp_path):
    family, extra = ARCHITECTURES["qwen2-biases"]
    build(family, extra, tmp_path)
    one, four = both(str(tmp_path), TP2 | PP2)
    assert four == one


@pytest.mark.parametrize("parallel", [TP2, PP2], ids=["tp2", "pp2"])
def test_builtin_gguf_kept_quantized_on_two_ranks(parallel):
    one, two = both(
        "builtin://smollm2-135m",
        parallel,
        quantization="auto",
        max_model_len=256,
        kv_cache_memory_bytes=16 << 20,
        block_size=16,
    )
    assert two == one


@pytest.mark.parametrize("parallel", [TP2, PP2], ids=["tp2", "pp2"])
def test_a_draft_on_rank_0_speculates_for_the_ranks(parallel, tmp_path):
    """The draft (the model itself: every draft token accepted) runs unsplit on rank 0
    beside its shard or first stage; the tokens are those of one rank with the same
    draft."""
    family, extra = ARCHITECTURES["qwen2-biases"]
    build(family, extra, tmp_path)
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3}
    one, two = both(str(tmp_path), parallel, speculative_config=spec)
    assert two == one


def test_structured_outputs_on_two_ranks_as_on_one():
    """A JSON schema's grammar masks rank 0's gathered logits: the same valid answers."""
    from pagefleet_serve.structured.constraint import StructuredOutputs

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=20, temperature=0, structured_outputs=StructuredOutputs(json=json.dumps(schema))
    )
    answers = []
    for size in (1, 2):
        llm = LLM(
            "builtin://smollm2-135m",
            dtype="float32",
            max_model_len=256,
            kv_cache_memory_bytes=16 << 20,
            tensor_parallel_size=size,
        )
        try:
            prompt = llm.chat_prompt([{"role": "user", "content": "Is the sky blue? JSON."}])
            answers.append(llm.generate([prompt], params)[0].outputs[0].text)
        finally:
            llm.engine.close()
    assert answers[1] == answers[0]
    assert json.loads(answers[0])["answer"] in ("yes", "no")


def test_each_stage_holds_its_layers_only(tmp_path):
    """Two stages of a 3-layer model, its head tied (Gemma 2): the first holds the
    embedding and layers 0-1, the last layer 2, the final norm and the embedding's rows
    for its head; together every weight once, but for those rows."""
    from pagefleet_serve.model.loader.model_loader import load_model
    from pagefleet_serve.model.tensor_parallel import TensorParallel

    family, extra = ARCHITECTURES["gemma2"]
    build(family, extra, tmp_path)
    whole = load_model(str(tmp_path), torch.float32)
    stages = [
        load_model(str(tmp_path), torch.float32, tp=TensorParallel(stage=s, stages=2))
        for s in (0, 1)
    ]

    def names(loaded) -> set[str]:
        """The weights a stage holds, by the model's names (its layer i is the model's
        layer first_layer + i); the tied head's rows are the embedding's."""
        first = loaded.model.first_layer
        held = set()
        for name in loaded.model.state_dict():
            if name.startswith("layers."):
                index, rest = name.removeprefix("layers.").split(".", 1)
                name = f"layers.{int(index) + first}.{rest}"
            if name != "lm_head.weight":
                held.add(name)
        return held

    def layers(weights: set[str]) -> set[int]:
        return {int(k.split(".")[1]) for k in weights if k.startswith("layers.")}

    first, last = (names(stage) for stage in stages)
    assert layers(first) == {0, 1} and layers(last) == {2}
    assert "embed_tokens.weight" in first and "norm.weight" not in first
    assert {"embed_tokens.weight", "norm.weight"} <= last
    assert first | last == names(whole)
    assert first & last == {"embed_tokens.weight"}


def _weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the embedding, LM head and the matrices split, bytes replicated)."""
    split = replicated = 0
    seen = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.data_ptr() in seen or name.endswith("inv_freq"):
            continue
        seen.add(tensor.data_ptr())
        size = tensor.numel() * tensor.element_size()
        if "norm" in name or name.endswith("mlp.gate.weight"):
            replicated += size
        else:
            split += size
    return split, replicated


def test_each_rank_holds_half_of_the_split_weights(tmp_path):
    """Rank 0's resident weights against one rank's: the split ones about halve (the key/
    value heads and vocabulary split evenly here), the norms are whole on each."""
    from pagefleet_serve.model.loader.model_loader import load_model
    from pagefleet_serve.model.tensor_parallel import TensorParallel

    family, extra = ARCHITECTURES["qwen2-biases"]
    build(family, extra, tmp_path)
    whole = load_model(str(tmp_path), torch.float32).model.state_dict()
    ranks = [
        load_model(str(tmp_path), torch.float32, tp=TensorParallel(r, 2)).model.state_dict()
        for r in (0, 1)
    ]

    def nbytes(weights: dict) -> int:
        return sum(w.numel() * w.element_size() for w in weights.values())

    norms = {k: v for k, v in whole.items() if "norm" in k}
    total, replicated = nbytes(whole), nbytes(norms)
    for rank in ranks:
        held = nbytes(rank)
        assert held == pytest.approx((total - replicated) / 2 + replicated, rel=0.01), (
            f"a rank holds {held} of {total} bytes ({replicated} replicated)"
        )
        assert {k: v.shape for k, v in rank.items() if "norm" in k} == {
            k: v.shape for k, v in norms.items()
        }
    # The two ranks' parts of q/k/v together are the whole: nothing lost, nothing doubled.
    name = "layers.0.self_attn.qkv_proj.weight"
    assert sum(r[name].shape[0] for r in ranks) == whole[name].shape[0]


def test_only_rank_0_loads_the_tokenizer():
    """The engine core (global rank 0) tokenizes, with the tokenizer the frontend loads for
    it; the other ranks run the model alone and load no tokenizer (the built-in model's is
    ~46 MiB resident, a worker's whole): the model loader reads none on any rank."""
    from pagefleet_serve.frontend.tokenizer import load_engine_tokenizer
    from pagefleet_serve.model.loader.model_loader import load_model
    from pagefleet_serve.model.tensor_parallel import TensorParallel

    ranks = [
        load_model("builtin://smollm2-135m", torch.bfloat16, "auto", tp=tp)
        for tp in (TensorParallel(0, 2), TensorParallel(1, 2), TensorParallel(stage=1, stages=2))
    ]
    assert [hasattr(loaded, "tokenizer") for loaded in ranks] == [False, False, False]
    tokenizer = load_engine_tokenizer(EngineConfig(model="builtin://smollm2-135m"))
    assert tokenizer.encode("Hello") != []


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"pipeline_parallel_size": 2, "task": "embed"}, "does not support task 'embed'"),
        ({"pipeline_parallel_size": 3, "nnodes": 2, "master_port": 1}, "split evenly"),
        ({"nnodes": 2}, "must split evenly over nnodes 2"),
        ({"nnodes": 2, "tensor_parallel_size": 2}, "needs master_port"),
        ({"nnodes": 2, "tensor_parallel_size": 2, "node_rank": 2, "master_port": 1}, "node_rank"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"tensor_parallel_size": 2, "enable_lora": True}, "does not support enable_lora"),
    ],
)
def test_unsupported_parallel_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_a_model_that_cannot_be_split_is_refused_and_its_workers_end():
    """tiny-random's 2 key/value heads over 4 ranks: 4 is a multiple of 2 and divides its 4
    heads, so that loads; 3 ranks is refused, naming the heads, with no worker left."""
    with pytest.raises(ValueError, match="key/value heads"):
        LLM("builtin://tiny-random", dtype="float32", tensor_parallel_size=3)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        LLM("builtin://tiny-random", dtype="float32", pipeline_parallel_size=3)
    assert not torch.distributed.is_initialized()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagefleet-tp")]


def test_whole_projection_norms_over_more_ranks_than_key_value_heads_are_refused():
    """OLMoE's k norm spans every key/value head: it cannot be summed over ranks that
    replicate one head each."""
    from pagefleet_serve.parallel_shape import ModelShape, check_shape

    shape = ModelShape(num_heads=4, num_kv_heads=2, num_layers=2, whole_kv_norm=True)
    check_shape(2, 1, shape)
    with pytest.raises(ValueError, match="cannot replicate: use at most 2 ranks"):
        check_shape(4, 1, shape)
