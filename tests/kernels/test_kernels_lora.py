"""The batched LoRA operator (`KernelBackend.add_lora`): the PyTorch forms, the C++ CPU
one and the Triton kernels (interpreted on the CPU without CUDA) against a naive loop over
rows in float64, over a batch whose rows read different slots or none, in each dtype, with
B dense or block-diagonal over a fused linear's parts (which the C++ operator must not
read off the blocks); and which backend declares which."""

import pytest
import torch
from pagefleet_kernels import cpu_attention, cpu_layer_ops, lora_ops, triton_lora
from pagefleet_kernels.backend import cpu_backend, torch_backend, triton_backend
from pagefleet_kernels.metadata import LoRAMapping

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def mapping_of(token_slots: list[int], device) -> LoRAMapping:
    """What the engine's step buffers build: each slot read with its rows, and the padded
    table of them (row 0 as padding: what a padding place computes is never read)."""

    def tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    present = sorted({s for s in token_slots if s >= 0})
    groups = [[row for row, s in enumerate(token_slots) if s == slot] for slot in present]
    width = max(map(len, groups))
    padded = [row for g in groups for row in g + [0] * (width - len(g))]
    positions = [k * width + j for k, g in enumerate(groups) for j in range(len(g))]
    return LoRAMapping(
        tensor(token_slots),
        [(slot, tensor(g)) for slot, g in zip(present, groups, strict=True)],
        tensor([row for g in groups for row in g]),
        tensor(padded),
        tensor(positions),
    )


IMPLEMENTATIONS = {
    "torch": lora_ops.add_lora,
    "padded": lora_ops.add_lora_padded,
    "cpu": cpu_layer_ops.add_lora,  # the C++ operator for float32, the padded form otherwise
    "triton": triton_lora.add_lora,
}


@pytest.mark.parametrize("num_slots", [3, 4])
@pytest.mark.parametrize("rows", [8, triton_lora.MAX_ROWS + 3])
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_add_lora_adds_each_rows_own_slot_and_leaves_the_others(
    dtype, implementation, rows, num_slots, device
):
    """Eight rows (the Triton kernels'), and more than they take (the gathered GEMMs);
    every slot read, or one left unread (the padded form then gathers the weights)."""
    generator = torch.Generator().manual_seed(0)
    rank, fan_in, fan_out = 24, 200, 136  # tiles of each kernel cut short
    token_slots = ([2, -1, 0, 2, 2, -1, 1, 0] * rows)[:rows]
    x = torch.randn(len(token_slots), fan_in, generator=generator)
    y = torch.randn(len(token_slots), fan_out, generator=generator)
    a = torch.randn(num_slots, rank, fan_in, generator=generator)
    b = torch.randn(num_slots, fan_out, rank, generator=generator)
    expected = y.double().clone()
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            expected[row] += b[slot].double() @ (a[slot].double() @ x[row].double())
    got = y.to(device, dtype)
    weights = (x.to(device, dtype), a.to(device, dtype), b.to(device, dtype))
    IMPLEMENTATIONS[implementation](got, *weights, mapping_of(token_slots, device))
    tolerance = TOLERANCE[dtype] * expected.abs().max().item()
    torch.testing.assert_close(got.cpu().double(), expected, atol=tolerance, rtol=0)
    unadapted = [row for row, slot in enumerate(token_slots) if slot < 0]
    assert torch.equal(got[unadapted].cpu(), y.to(dtype)[unadapted])


@pytest.mark.parametrize("rank", [8, 5])  # the C++ expand's 8-wide tiles, and its scalar tail
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_add_lora_over_the_parts_of_a_fused_linear(implementation, rank, device):
    """B block-diagonal over parts of 72, 40 and 21 outputs (tiles cut short at each part's
    end): every operator adds the same as the naive loop, and none reads the NaNs off the
    blocks when it is told the parts (the PyTorch forms are told, and read B whole only
    when it is dense: here they are handed B with its zeros)."""
    generator = torch.Generator().manual_seed(1)
    parts, fan_in, num_slots = (72, 40, 21), 200, 3
    token_slots = [2, -1, 0, 2, 1, 1, -1, 0, 2]
    x = torch.randn(len(token_slots), fan_in, generator=generator)
    y = torch.randn(len(token_slots), sum(parts), generator=generator)
    a = torch.randn(num_slots, len(parts) * rank, fan_in, generator=generator)
    b = torch.zeros(num_slots, sum(parts), len(parts) * rank)
    off_blocks = torch.ones_like(b, dtype=torch.bool)
    first = 0
    for part, size in enumerate(parts):
        block = (slice(None), slice(first, first + size), slice(part * rank, (part + 1) * rank))
        b[block] = torch.randn(num_slots, size, rank, generator=generator)
        off_blocks[block] = False
        first += size
    expected = y.double().clone()
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            expected[row] += b[slot].double() @ (a[slot].double() @ x[row].double())
    native = implementation == "cpu" and cpu_layer_ops.available() and device.type == "cpu"
    got = y.to(device)
    b = b.masked_fill(off_blocks, float("nan")) if native else b
    IMPLEMENTATIONS[implementation](
        got, x.to(device), a.to(device), b.to(device), mapping_of(token_slots, device), parts
    )
    tolerance = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(got.cpu().double(), expected, atol=tolerance, rtol=0)


def test_the_cpu_operator_refuses_parts_that_do_not_fit():
    if not cpu_layer_ops.available():
        pytest.skip("the C++ layer ops are not built for this CPU")
    y, x = torch.zeros(2, 10), torch.zeros(2, 4)
    a, b = torch.zeros(1, 6, 4), torch.zeros(1, 10, 6)
    mapping = mapping_of([0, -1], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="the parts do not add up to 10"):
        cpu_layer_ops.add_lora(y, x, a, b, mapping, (4, 4, 4))
    with pytest.raises(RuntimeError, match="rank 6 is not a multiple of the 4 parts"):
        cpu_layer_ops.add_lora(y, x, a, b, mapping, (1, 2, 3, 4))
    with pytest.raises(RuntimeError, match="row 0 reads slot 3 of 1"):
        cpu_layer_ops.add_lora(y, x, a, b, mapping_of([3, -1], torch.device("cpu")))


def test_each_backend_declares_its_operator():
    assert torch_backend().add_lora is lora_ops.add_lora
    assert triton_backend().add_lora is triton_lora.add_lora
    if cpu_attention.available():
        native = cpu_layer_ops.add_lora if cpu_layer_ops.available() else lora_ops.add_lora_padded
        assert cpu_backend().add_lora is native
