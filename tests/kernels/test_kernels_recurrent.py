"""The recurrent operators of hybrid models (`causal_conv1d`, `gated_delta_rule`, `ssd`):
both implementations a backend can declare (the definitions a token at a time, the chunked
forms) against transformers' own PyTorch functions for one sequence continuing from a
random state (its output and its final state), and against each other over flattened
batches that mix one-token and longer sequences in shuffled slots, some starting from zero
over rows of NaN, with the rows no sequence names left untouched."""

import pytest
import torch
from pagefleet_kernels.backend import RecurrentOps, recurrent_chunked, recurrent_reference
from pagefleet_kernels.state_batch import metadata
from transformers.models.mamba2 import modeling_mamba2 as hf_mamba2
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next

IMPLEMENTATIONS = {"reference": recurrent_reference(), "chunked": recurrent_chunked()}
# float32 throughout; the chunked forms sum in another order than the recurrences.
TOLERANCE = {"atol": 5e-5, "rtol": 5e-5}
# Lengths across the chunk sizes: a decode token, a few tokens, one exact chunk, several.
LENGTHS = [1, 5, 64, 150]
SLOTS = 6


@pytest.fixture(params=list(IMPLEMENTATIONS))
def ops(request) -> RecurrentOps:
    return IMPLEMENTATIONS[request.param]


def one_sequence(length: int, slot: int = 2):
    return metadata([length], [slot], [True])


def stale(shape, dtype=torch.float32) -> torch.Tensor:
    """A state tensor whose rows hold NaN: a sequence that reads a row it must not fails."""
    return torch.full((SLOTS, *shape), float("nan"), dtype=dtype)


# -- against transformers ----------------------------------------------------------------
def delta_inputs(length, k_heads, v_heads, k_dim=16, v_dim=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(length, k_heads, k_dim, generator=gen),
        torch.randn(length, k_heads, k_dim, generator=gen),
        torch.randn(length, v_heads, v_dim, generator=gen),
        -2 * torch.rand(length, v_heads, generator=gen),
        torch.rand(length, v_heads, generator=gen),
        torch.randn(v_heads, k_dim, v_dim, generator=gen),
    )


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("heads", [(2, 4), (3, 3)], ids=["gqa", "mha"])
def test_gated_delta_rule_matches_transformers(ops, length, heads):
    q, k, v, g, beta, initial = delta_inputs(length, *heads)
    batch = (x[None] for x in (q, k, v, g, beta))
    if length == 1:  # the decode step: transformers' recurrent form
        expected, final = hf_qwen3_next.torch_recurrent_gated_delta_rule(
            *batch,
            initial_state=initial[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
    else:
        expected, final = hf_qwen3_next.torch_chunk_gated_delta_rule(
            *batch,
            initial_state=initial[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
    state = stale(initial.shape)
    state[2] = initial
    out = ops.gated_delta_rule(q, k, v, g, beta, state, one_sequence(length), q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, expected[0], **TOLERANCE)
    torch.testing.assert_close(state[2], final[0], **TOLERANCE)
    assert state[[0, 1, 3, 4, 5]].isnan().all()


def ssd_inputs(length, heads=8, dim=4, groups=2, size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(length, heads, dim, generator=gen),
        torch.randn(length, heads, generator=gen),
        -torch.rand(heads, generator=gen) * 4 - 0.1,
        torch.randn(length, groups, size, generator=gen),
        torch.randn(length, groups, size, generator=gen),
        torch.randn(heads, generator=gen),
        torch.randn(heads, generator=gen),
        torch.randn(heads, dim, size, generator=gen),
    )


@pytest.mark.parametrize("length", [5, 64, 150])
@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 1.5)], ids=["no-limit", "limit"])
def test_ssd_chunk_scan_matches_transformers(ops, length, groups, limit):
    x, dt, A, B, C, D, dt_bias, initial = ssd_inputs(length, groups=groups)
    expected, final = hf_mamba2.mamba2_chunk_scan(
        x[None], dt[None], A, B[None], C[None], chunk_size=32, D=D, dt_bias=dt_bias,
        initial_states=initial[None], dt_softplus=True, dt_limit=limit, return_final_states=True,
    )  # fmt: skip
    state = stale(initial.shape)
    state[2] = initial
    out = ops.ssd(x, dt, A, B, C, D, dt_bias, state, one_sequence(length), limit, 32)
    torch.testing.assert_close(out, expected[0], **TOLERANCE)
    torch.testing.assert_close(state[2], final[0], **TOLERANCE)


@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_step_matches_transformers_selective_state_update(ops, groups):
    x, dt, A, B, C, D, dt_bias, initial = ssd_inputs(1, groups=groups)
    _, dim, size = initial.shape
    hf_state = initial[None].clone()
    expected = hf_mamba2.mamba2_selective_state_update(
        hf_state, x, dt[:, :, None].expand(-1, -1, dim), A[:, None, None].expand(-1, dim, size),
        B, C, D[:, None].expand(-1, dim), dt_bias=dt_bias[:, None].expand(-1, dim), dt_softplus=True,
    )  # fmt: skip
    state = stale(initial.shape)
    state[2] = initial
    out = ops.ssd(x, dt, A, B, C, D, dt_bias, state, one_sequence(1))
    torch.testing.assert_close(out, expected, **TOLERANCE)
    torch.testing.assert_close(state[2], hf_state[0], **TOLERANCE)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("silu", [True, False])
def test_causal_conv1d_matches_transformers_update(ops, length, silu):
    """transformers' causal_conv1d_update over any length: its state in front, the last
    kernel - 1 inputs kept."""
    gen = torch.Generator().manual_seed(length)
    channels, width = 12, 4
    x, weight, bias = (
        torch.randn(*s, generator=gen) for s in ((length, channels), (channels, width), (channels,))
    )
    initial = torch.randn(channels, width - 1, generator=gen)
    hf_state = initial[None].clone()
    expected = hf_mamba2.causal_conv1d_update(
        x.T[None], hf_state, weight, bias, activation="silu" if silu else None
    )[0].T
    state = stale(initial.shape)
    state[2] = initial
    out = ops.causal_conv1d(x, weight, bias, state, one_sequence(length), silu)
    torch.testing.assert_close(out, expected, **TOLERANCE)
    torch.testing.assert_close(state[2], hf_state[0], **TOLERANCE)


# -- mixed batches: the chunked forms against the definitions --------------------------
# (length, slot, continues from its state) of each sequence: decode rows and prompt chunks
# interleaved, slots out of order, two starting from zero over NaN rows.
BATCH = [(1, 4, True), (37, 0, False), (1, 2, False), (130, 5, True), (2, 1, True)]


def batch_meta():
    lengths, slots, initial = zip(*BATCH, strict=True)
    return metadata(list(lengths), list(slots), list(initial))


def batch_state(shape) -> torch.Tensor:
    """Random rows for the sequences that continue, NaN for the others' and slot 3."""
    state = stale(shape)
    gen = torch.Generator().manual_seed(7)
    for _, slot, initial in BATCH:
        if initial:
            state[slot] = torch.randn(shape, generator=gen)
    return state


def assert_batch_matches(run) -> None:
    """`run(ops, state)` -> output: the chunked forms give the definitions' outputs and
    states; slot 3, which no sequence names, keeps its NaN."""
    outputs, states = {}, {}
    for name, ops in IMPLEMENTATIONS.items():
        states[name], outputs[name] = run(ops)
        assert not outputs[name].isnan().any()
    torch.testing.assert_close(outputs["chunked"], outputs["reference"], **TOLERANCE)
    used = [slot for _, slot, _ in BATCH]
    torch.testing.assert_close(states["chunked"][used], states["reference"][used], **TOLERANCE)
    assert states["chunked"][3].isnan().all() and states["reference"][3].isnan().all()


def test_gated_delta_rule_mixed_batch():
    tokens = sum(n for n, _, _ in BATCH)
    q, k, v, g, beta, _ = delta_inputs(tokens, 2, 4, seed=3)

    def run(ops):
        state = batch_state((4, 16, 24))
        return state, ops.gated_delta_rule(q, k, v, g, beta, state, batch_meta(), 0.25)

    assert_batch_matches(run)


def test_ssd_mixed_batch():
    tokens = sum(n for n, _, _ in BATCH)
    x, dt, A, B, C, D, dt_bias, _ = ssd_inputs(tokens, seed=3)

    def run(ops):
        state = batch_state((8, 4, 16))
        return state, ops.ssd(x, dt, A, B, C, D, dt_bias, state, batch_meta(), chunk_size=32)

    assert_batch_matches(run)


def test_causal_conv1d_mixed_batch():
    tokens = sum(n for n, _, _ in BATCH)
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(tokens, 12, generator=gen), torch.randn(12, 4, generator=gen)

    def run(ops):
        state = batch_state((12, 3))
        return state, ops.causal_conv1d(x, weight, None, state, batch_meta(), True)

    assert_batch_matches(run)


def test_bfloat16_inputs_keep_their_dtype_and_a_float32_state(ops):
    """Inputs in bfloat16 give bfloat16 outputs near the float32 ones; the state stays in
    float32."""
    q, k, v, g, beta, initial = delta_inputs(20, 2, 4)
    meta = metadata([1, 19], [0, 1], [True, True])
    outputs = []
    for dtype in (torch.float32, torch.bfloat16):
        state = initial.expand(2, -1, -1, -1).clone()
        outputs.append(
            ops.gated_delta_rule(q.to(dtype), k.to(dtype), v.to(dtype), g, beta, state, meta, 0.25)
        )
        assert state.dtype == torch.float32
    assert outputs[1].dtype == torch.bfloat16
    torch.testing.assert_close(outputs[1].float(), outputs[0], atol=5e-2, rtol=5e-2)
