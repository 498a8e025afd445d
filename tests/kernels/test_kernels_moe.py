"""The mixture-of-experts operator: the CPU backend's grouped path (`moe.grouped_fused_moe`
with the C++ few-row matmul) and the Triton grouped GEMM (`triton_moe`, interpreted on the
CPU, compiled on CUDA) against the reference loop over experts (`moe.fused_moe`), across
token counts from a decode row to 512, 8-64 experts, top 1-8, and uneven loads (gpt-oss's
biased experts with the clamped SwiGLU too): most
tokens crowd onto a few experts and a quarter of the experts get none. Also the router and
the alignment of pairs into per-expert tiles, with exact ids."""

import functools

import pytest
import torch
from pagefleet_kernels import cpu_attention, cpu_layer_ops, moe, triton_moe
from pagefleet_kernels.backend import cpu_backend, torch_backend, triton_backend

HIDDEN, INTERMEDIATE = 64, 32
# (tokens, experts, top k): decode rows, prefill chunks, every expert count and k.
CASES = [(1, 8, 1), (1, 64, 8), (3, 8, 2), (16, 16, 4), (33, 64, 2), (64, 8, 8), (64, 64, 6)]
# The interpreter runs one program at a time: the widest batches on the CPU path only.
CPU_CASES = [*CASES, (128, 32, 2), (512, 64, 8), (512, 8, 2)]
# The products' roundings differ from the reference's (tile order, one rounding of the
# weighted product, the k rows summed in float32): within a few units of the dtype.
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 1.5e-2, "rtol": 1e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
DTYPES = list(TOLERANCES)


def moe_inputs(tokens: int, experts: int, top_k: int, dtype, device="cpu", seed: int = 0):
    """x, the stacked weights, and a routing in which experts 0..k+1 are favoured and the
    last quarter never chosen (when top_k leaves room): uneven loads, empty experts."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)

    x = randn(tokens, HIDDEN)
    gate_up = randn(experts, 2 * INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5)
    down = randn(experts, HIDDEN, INTERMEDIATE, scale=INTERMEDIATE**-0.5)
    logits = torch.randn(tokens, experts, generator=generator)
    logits[:, : top_k + 2] += 3.0
    if top_k <= experts * 3 // 4:
        logits[:, experts * 3 // 4 :] = -float("inf")
    weights, ids = moe.route(logits, top_k, renormalize=True)
    return x, gate_up, down, weights.to(dtype).to(device), ids.to(device)


def cases(values) -> list:
    return [pytest.param(*case, id="t{}-e{}-k{}".format(*case)) for case in values]


def cpu_fused_moe():
    """The cpu backend's declared operator (grouped, with the C++ few-row matmul)."""
    if not cpu_attention.available():
        pytest.skip("no C++ compiler: the engine uses the torch backend")
    op = cpu_backend().fused_moe
    assert op is not None
    return op


class NoFallback:
    """Stands in for `moe` inside `triton_moe`: a fallback fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"fell back to moe.{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), cases(CPU_CASES))
def test_cpu_grouped_path_equals_the_reference(tokens, experts, top_k, dtype):
    x, gate_up, down, weights, ids = moe_inputs(tokens, experts, top_k, dtype)
    load = moe.expert_load(ids, experts)
    if tokens * top_k >= experts and top_k <= experts * 3 // 4:
        assert (load == 0).any() and load.max() > 2 * load[load > 0].min()  # uneven
    expected = moe.fused_moe(x, gate_up, down, weights, ids)
    actual = cpu_fused_moe()(x, gate_up, down, weights, ids, False)
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), cases(CASES))
def test_triton_grouped_gemm_equals_the_reference(tokens, experts, top_k, dtype, monkeypatch):
    device = triton_moe.triton_layer_ops.KERNEL_DEVICE
    x, gate_up, down, weights, ids = moe_inputs(tokens, experts, top_k, dtype, device)
    expected = moe.fused_moe(x, gate_up, down, weights, ids)
    monkeypatch.setattr(triton_moe, "moe", NoFallback())
    actual = triton_moe.fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_gelu_experts(name):
    x, gate_up, down, weights, ids = moe_inputs(5, 8, 2, torch.float32)
    expected = moe.fused_moe(x, gate_up, down, weights, ids, True)
    op = cpu_fused_moe() if name == "cpu" else triton_moe.fused_moe
    actual = op(x, gate_up, down, weights, ids, True)
    torch.testing.assert_close(actual, expected, **TOLERANCES[torch.float32])
    assert not torch.allclose(actual, moe.fused_moe(x, gate_up, down, weights, ids, False))


def test_each_backend_declares_its_implementation():
    assert torch_backend().fused_moe is moe.fused_moe
    assert triton_backend().fused_moe is triton_moe.fused_moe
    if cpu_attention.available():
        op = cpu_backend().fused_moe
        assert isinstance(op, functools.partial) and op.func is moe.grouped_fused_moe
        few_rows = cpu_layer_ops.linear if cpu_layer_ops.available() else None
        assert op.keywords == {"linear": few_rows, "act_and_mul": cpu_layer_ops.act_and_mul}


def test_align_by_expert_pads_each_experts_run_to_whole_tiles():
    # Tokens 0-2 pick (expert, expert): pairs 0..5 are (0:2, 1:0, 2:2, 3:3, 4:0, 5:2).
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    sorted_pairs, block_experts = triton_moe.align_by_expert(ids, num_experts=5, block_m=4)
    pad = 6
    # expert 0: pairs 1, 4; expert 2: 0, 2, 5; expert 3: 3; experts 1 and 4: none.
    # Capacity: 6 pairs + 5 experts (at most 6) * 3 of padding = 21 -> 24 (6 tiles).
    assert sorted_pairs.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad] + [pad] * 12
    assert block_experts.tolist() == [0, 2, 3, -1, -1, -1]


def test_route_softmax_top_k_renormalized_and_sigmoid():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 1.0]])
    weights, ids = moe.route(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 2], [2, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = moe.route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    weights, ids = moe.route(logits, 1, renormalize=False, scoring="sigmoid")
    torch.testing.assert_close(weights[:, 0], torch.sigmoid(torch.tensor([3.0, 5.0])))


def test_triton_falls_back_for_what_it_does_not_take():
    """Weights whose inputs are not contiguous go to the grouped torch path."""
    x, gate_up, down, weights, ids = moe_inputs(4, 8, 2, torch.float32)
    strided = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    expected = moe.fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(triton_moe.fused_moe(x, strided, down, weights, ids), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["cpu", "triton"])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"), cases([(1, 8, 2), (33, 16, 4), (64, 32, 4)])
)
def test_gpt_oss_variant_equals_the_reference(tokens, experts, top_k, name, dtype, monkeypatch):
    """Experts with biases (added after each matmul, the routing weight after the down
    bias) and the clamped SwiGLU, whose clamp bites on most rows, on uneven loads."""
    device = "cpu" if name == "cpu" else triton_moe.triton_layer_ops.KERNEL_DEVICE
    x, gate_up, down, weights, ids = moe_inputs(tokens, experts, top_k, dtype, device)
    generator = torch.Generator().manual_seed(1)
    variant = {
        "gate_up_bias": torch.randn(experts, 2 * INTERMEDIATE, generator=generator).to(dtype),
        "down_bias": torch.randn(experts, HIDDEN, generator=generator).to(dtype),
        "activation": moe.ClampedSwiGLU(alpha=1.702, limit=0.5),
    }
    variant = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in variant.items()}
    expected = moe.fused_moe(x, gate_up, down, weights, ids, **variant)
    if name == "cpu":
        actual = cpu_fused_moe()(x, gate_up, down, weights, ids, False, **variant)
    else:
        monkeypatch.setattr(triton_moe, "moe", NoFallback())
        actual = triton_moe.fused_moe(x, gate_up, down, weights, ids, **variant)
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])
    plain = moe.fused_moe(x, gate_up, down, weights, ids)
    assert not torch.allclose(expected, plain, atol=1e-2)  # the variant is really applied
