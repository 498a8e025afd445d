"""Tensor parallelism over gloo (two ranks, float32): greedy tokens equal one rank's for
tiny random checkpoints (Qwen2's q/k/v biases, Qwen3's q/k norms with o biases, a Qwen2-MoE
with a shared expert and a dense layer) and for the built-in GGUF model kept quantized
(Q4_1/Q8_0 split at whole blocks; its 3 key/value heads split 2 and 1), on prompts whose
long prefill runs in chunks beside decodes, with a prefix-cache hit and n > 1. Each rank
holds its part of the weights: about half of the split ones, all of the replicated."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.config import EngineConfig

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


def both(model: str, **settings) -> tuple[list, list]:
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
    llm = LLM(model, tensor_parallel_size=2, **settings)
    try:
        assert llm.engine.workers is not None and llm.engine.workers.size == 2
        return one, run(llm)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("arch", ["qwen2-biases", "qwen3-qk-norm", "qwen2-moe-shared-expert"])
def test_two_ranks_give_one_ranks_tokens(arch, tmp_path):
    family, extra = ARCHITECTURES[arch]
    build(family, extra, tmp_path)
    one, two = both(str(tmp_path))
    assert two == one


def test_builtin_gguf_kept_quantized_on_two_ranks():
    one, two = both(
        "builtin://smollm2-135m",
        quantization="auto",
        max_model_len=256,
        kv_cache_memory_bytes=16 << 20,
        block_size=16,
    )
    assert two == one


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
    from pagefleet_serve.model.loader import load_model
    from pagefleet_serve.model.tensor_parallel import TensorParallel

    family, extra = ARCHITECTURES["qwen2-biases"]
    build(family, extra, tmp_path)
    whole = load_model(str(tmp_path), torch.float32)
    ranks = [load_model(str(tmp_path), torch.float32, tp=TensorParallel(r, 2)) for r in (0, 1)]

    def nbytes(weights: dict) -> int:
        return sum(w.numel() * w.element_size() for w in weights.values())

    norms = {k: v for k, v in whole.weights.items() if "norm" in k}
    total, replicated = nbytes(whole.weights), nbytes(norms)
    for rank in ranks:
        held = nbytes(rank.weights)
        assert held == pytest.approx((total - replicated) / 2 + replicated, rel=0.01), (
            f"a rank holds {held} of {total} bytes ({replicated} replicated)"
        )
        assert {k: v.shape for k, v in rank.weights.items() if "norm" in k} == {
            k: v.shape for k, v in norms.items()
        }
    # The two ranks' parts of q/k/v together are the whole: nothing lost, nothing doubled.
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert sum(r.weights[name].shape[0] for r in ranks) == whole.weights[name].shape[0]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size 2 is not supported yet"),
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
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagefleet-tp")]
