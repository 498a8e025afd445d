"""The batched LoRA operator (`KernelBackend.add_lora`): the PyTorch form and the Triton
kernels (interpreted on the CPU without CUDA) against a naive loop over rows in float64,
over a batch whose rows read different slots or none, in each dtype; and which backend
declares which."""

import pytest
import torch
from pagefleet_kernels import cpu_attention, lora_ops, triton_lora
from pagefleet_kernels.backend import LoRAMapping, cpu_backend, torch_backend, triton_backend

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


def test_each_backend_declares_its_operator():
    assert torch_backend().add_lora is lora_ops.add_lora
    assert triton_backend().add_lora is triton_lora.add_lora
    if cpu_attention.available():
        assert cpu_backend().add_lora is lora_ops.add_lora_padded
